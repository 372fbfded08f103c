"""The analytical prefill performance model of paper Appendix B (Table 5, Figs. 9 and 11), and the training
all-to-all window of Sec. 4.1 (Eq. 9).

A hypothetical accelerator runs core attention at ``attn_tflops`` and every GEMM at ``gemm_tflops``; all-reduce and
all-to-all move data at the given *bus* bandwidths (NCCL's convention: an all-reduce of ``m`` bytes over ``n`` ranks
takes ``m * 2(n-1)/n / bw``, an all-to-all of ``m`` bytes per rank ``m * (n-1)/n / bw``).

Decisions where the paper is silent (stated so users can judge the numbers):
- GEMM FLOPs come from the model's own parameter shapes (a ``meta``-device build of the config): 2 FLOPs per weight
  per token; core attention is causal, ``2 * S^2/2 * heads * (d_qk + d_v)`` per sequence; chunked/sliding windows are
  ignored (full causal attention, an upper bound).
- Inference layout (Sec. 4.2): activations replicated; attention, shared experts and dense MLPs split over TP;
  routed experts over EP with perfect balance; the router is replicated.
- Regular layer: ``attn + AR + gate + routed + shared + AR``. FarSkip MoE layer (Table 5, with the exposed time
  ``max(0, comm - overlappable)``, where the paper's table prints ``min``): the attention+shared all-reduce hides
  behind the routed experts, the routed all-reduce behind the next attention. Dense layers stay regular.
- Training (Sec. 4.1, Eq. 9): attention replicated, experts over EP; Dispatch and Combine are all-to-alls of
  ``tokens * top_k * hidden`` bf16 values; FarSkip hides them behind ``T_layer - T_routed - T_gate``. Backward is
  modelled as twice the forward compute with the same two all-to-alls.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SCENARIOS = {
    "baseline": dict(),
    "2x_compute": dict(attn=2.0, gemm=2.0),
    "2x_attention": dict(attn=2.0),
    "2x_comm": dict(comm=2.0),
    "2x_compute_2x_comm": dict(attn=2.0, gemm=2.0, comm=2.0),
}

# DeepSeek-V3's public config.json, so that the paper's setting runs offline (`--preset deepseek-v3`).
PRESETS = {
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_group=8,
        topk_group=4,
    ),
}


@dataclass(frozen=True)
class Hardware:
    attn_tflops: float = 500.0
    gemm_tflops: float = 600.0
    allreduce_gbps: float = 400.0
    alltoall_gbps: float = 300.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value > 0):  # 0 divided by zero, NaN and negatives printed nonsense
                raise ValueError(f"--{name.replace('_', '-')} {value}: a throughput must be a finite number > 0")

    def scaled(self, attn: float = 1.0, gemm: float = 1.0, comm: float = 1.0) -> Hardware:
        return Hardware(
            self.attn_tflops * attn, self.gemm_tflops * gemm, self.allreduce_gbps * comm, self.alltoall_gbps * comm
        )


@dataclass(frozen=True)
class LayerShape:
    """Per-token GEMM FLOPs of one decoder layer and its attention geometry."""

    attn_proj_flops: float
    heads: int
    d_qk: int
    d_v: int
    moe: bool
    gate_flops: float = 0.0
    routed_flops: float = 0.0  # top_k experts per token
    shared_flops: float = 0.0  # shared experts, or the whole MLP of a dense layer


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    vocab: int
    num_experts: int
    top_k: int
    layers: tuple[LayerShape, ...]


def _weights(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def model_shape(config) -> ModelShape:
    """Read FLOP-relevant shapes from a transformers config of a supported MoE family (no weights are loaded)."""
    from fcsd.connectivity.families import expert_count, family_for_config, find_decoder_layers, meta_model, text_config

    family = family_for_config(config)
    decoder = text_config(config)
    model = meta_model(config)
    top_k = int(getattr(decoder, family.top_k_attr))
    heads = decoder.num_attention_heads
    if getattr(decoder, "kv_lora_rank", None):  # MLA
        d_qk, d_v = decoder.qk_nope_head_dim + decoder.qk_rope_head_dim, decoder.v_head_dim
    else:
        d_qk = d_v = getattr(decoder, "head_dim", None) or decoder.hidden_size // heads
    layers, num_experts = [], 0
    for layer in find_decoder_layers(model, family):
        mlp = getattr(layer, family.mlp_attr)
        attn = dict(attn_proj_flops=2.0 * _weights(layer.self_attn), heads=heads, d_qk=d_qk, d_v=d_v)
        if not family.is_moe(mlp):
            layers.append(LayerShape(moe=False, shared_flops=2.0 * _weights(mlp), **attn))
            continue
        experts = getattr(mlp, family.experts_attr)
        num_experts = expert_count(experts)
        routed = _weights(experts)
        gate = _weights(mlp) - routed - sum(_weights(m) for n, m in mlp.named_children() if "shared" in n)
        shared = _weights(mlp) - routed - gate
        layers.append(
            LayerShape(
                moe=True,
                gate_flops=2.0 * gate,
                routed_flops=2.0 * routed * top_k / num_experts,
                shared_flops=2.0 * shared,
                **attn,
            )
        )
    if not num_experts:
        raise ValueError(
            f"{config.model_type}: no MoE layer in this model; the perfmodel needs a mixture-of-experts model"
        )
    return ModelShape(decoder.hidden_size, decoder.vocab_size, num_experts, top_k, tuple(layers))


def with_sparsity(config, sparsity: int):
    """Appendix B's sparsity scaling: keep ``top_k`` routed (+ shared) experts active, use ``top_k * sparsity``
    experts, and divide the expert width by the same factor (total parameters stay about constant)."""
    from fcsd.connectivity.families import text_config

    config = copy.deepcopy(config)
    decoder = text_config(config)
    experts_attr = next(a for a in ("n_routed_experts", "num_local_experts", "num_experts") if hasattr(decoder, a))
    width_attr = "moe_intermediate_size" if hasattr(decoder, "moe_intermediate_size") else "intermediate_size"
    experts, top_k = getattr(decoder, experts_attr), decoder.num_experts_per_tok
    factor = sparsity / (experts / top_k)
    width = getattr(decoder, width_attr) / factor
    if not width.is_integer() or width < 1:
        raise ValueError(f"sparsity {sparsity} gives a non-integer expert width {width}; pick a power-of-two factor")
    setattr(decoder, experts_attr, top_k * sparsity)
    setattr(decoder, width_attr, int(width))
    if hasattr(decoder, "n_group") and decoder.n_group:  # group-limited routing needs experts divisible by groups
        decoder.n_group = min(decoder.n_group, top_k * sparsity)
        if getattr(decoder, "topk_group", None):  # ... and enough experts in the groups a token may use
            per_group = top_k * sparsity // decoder.n_group
            decoder.topk_group = min(decoder.n_group, max(decoder.topk_group, -(-top_k // per_group)))
    return config


def default_sparsities(config) -> list[int]:
    """The model's own sparsity (routed experts / active routed experts) and three doublings (DeepSeek-V3: 32, 64,
    128, 256, the paper's Fig. 9 axis), keeping those whose scaled expert width is a whole number."""
    from fcsd.connectivity.families import text_config

    decoder = text_config(config)
    experts = next(
        getattr(decoder, a) for a in ("n_routed_experts", "num_local_experts", "num_experts") if hasattr(decoder, a)
    )
    own = max(1, experts // decoder.num_experts_per_tok)
    found = []
    for sparsity in (own, 2 * own, 4 * own, 8 * own):
        try:
            with_sparsity(config, sparsity)
        except ValueError:
            break
        found.append(sparsity)
    return found


def allreduce_s(nbytes: float, ranks: int, hw: Hardware) -> float:
    return 0.0 if ranks <= 1 else nbytes * 2 * (ranks - 1) / ranks / (hw.allreduce_gbps * 1e9)


def alltoall_s(nbytes: float, ranks: int, hw: Hardware) -> float:
    return 0.0 if ranks <= 1 else nbytes * (ranks - 1) / ranks / (hw.alltoall_gbps * 1e9)


@dataclass
class LayerTimes:
    attn: float
    gate: float
    routed: float
    shared: float
    attn_comm: float
    mlp_comm: float
    moe: bool

    @property
    def compute(self) -> float:
        return self.attn + self.gate + self.routed + self.shared

    @property
    def regular(self) -> float:
        return self.compute + self.attn_comm + self.mlp_comm

    @property
    def exposed_attn_shared(self) -> float:
        """Table 5, FarSkip: the attention + shared all-reduce behind the routed experts."""
        return max(0.0, self.attn_comm - self.routed)

    @property
    def exposed_routed(self) -> float:
        """Table 5, FarSkip: the routed all-reduce behind the next layer's attention."""
        return max(0.0, self.mlp_comm - self.attn)

    @property
    def farskip(self) -> float:
        if not self.moe:
            return self.regular
        return self.compute + self.exposed_attn_shared + self.exposed_routed


def prefill_layer_times(
    shape: ModelShape, layer: LayerShape, batch: int, context: int, tp: int, ep: int, hw: Hardware, dtype_bytes: int = 2
) -> LayerTimes:
    tokens = batch * context
    gemm, attn_rate = hw.gemm_tflops * 1e12, hw.attn_tflops * 1e12
    core = batch * context * context / 2 * 2 * layer.heads * (layer.d_qk + layer.d_v)
    attn = tokens * layer.attn_proj_flops / tp / gemm + core / tp / attn_rate
    comm = allreduce_s(tokens * shape.hidden * dtype_bytes, tp, hw)
    return LayerTimes(
        attn=attn,
        gate=tokens * layer.gate_flops / gemm,
        routed=tokens * layer.routed_flops / ep / gemm,
        shared=tokens * layer.shared_flops / tp / gemm,
        attn_comm=comm,
        mlp_comm=comm,
        moe=layer.moe,
    )


class _Comparison:
    """Regular vs FarSkip times of a dataclass result, with their ratio."""

    regular_ms: float
    farskip_ms: float

    @property
    def speedup(self) -> float:
        return self.regular_ms / self.farskip_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


@dataclass
class PrefillResult(_Comparison):
    sparsity: int
    scenario: str
    regular_ms: float
    farskip_ms: float
    exposed_regular_ms: float
    exposed_farskip_ms: float


def prefill(
    shape: ModelShape,
    batch: int = 32,
    context: int = 2048,
    tp: int = 8,
    ep: int = 8,
    hw: Hardware = Hardware(),
    sparsity: int = 0,
    scenario: str = "baseline",
) -> PrefillResult:
    """End-to-end prefill time, regular vs FarSkip, with the exposed communication (Appendix B, Table 5)."""
    times = [prefill_layer_times(shape, layer, batch, context, tp, ep, hw) for layer in shape.layers]
    head = batch * 2.0 * shape.hidden * shape.vocab / tp / (hw.gemm_tflops * 1e12)  # last-token logits only
    regular = sum(t.regular for t in times) + head
    farskip = sum(t.farskip for t in times) + head
    exposed_regular = sum(t.attn_comm + t.mlp_comm for t in times)
    exposed_farskip = sum(t.farskip - t.compute for t in times)
    return PrefillResult(sparsity, scenario, regular * 1e3, farskip * 1e3, exposed_regular * 1e3, exposed_farskip * 1e3)


def sweep(
    config,
    sparsities: list[int],
    scenarios: list[str],
    batch: int = 32,
    context: int = 2048,
    tp: int = 8,
    ep: int = 8,
    hw: Hardware = Hardware(),
) -> list[PrefillResult]:
    """Figs. 9 and 11: prefill speedup for each sparsity factor and hardware scenario."""
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    rows = []
    for sparsity in sparsities:
        shape = model_shape(with_sparsity(config, sparsity))
        for scenario in scenarios:
            rows.append(prefill(shape, batch, context, tp, ep, hw.scaled(**SCENARIOS[scenario]), sparsity, scenario))
    return rows


@dataclass
class TrainingResult(_Comparison):
    tokens_per_gpu: int
    dispatch_combine_ms: float  # forward; backward has the same two all-to-alls
    overlap_window_ms: float  # Eq. 9: T_layer - T_routed - T_gate (forward)
    regular_ms: float  # forward + backward per MoE layer
    farskip_ms: float


def training_moe_layer(
    shape: ModelShape, batch: int, context: int, ep: int, hw: Hardware = Hardware(), dtype_bytes: int = 2
) -> TrainingResult:
    """Sec. 4.1 / Eq. 9 for one MoE layer in training, per GPU: ``batch`` sequences of ``context`` tokens, attention
    replicated (data parallel), experts over EP with perfect balance (each GPU hosts 1/ep of the experts and
    receives ep times its share of tokens, so its routed work equals its own tokens' routed work).

    Forward exposes ``max(0, dispatch + combine - window)`` with Eq. 9's window ``T_layer - T_routed - T_gate``;
    backward has the same two all-to-alls against twice the window (backward compute = 2 x forward).
    """
    layer = next(layer for layer in shape.layers if layer.moe)
    t = prefill_layer_times(shape, layer, batch, context, tp=1, ep=1, hw=hw)
    tokens = batch * context
    a2a = 2 * alltoall_s(tokens * shape.top_k * shape.hidden * dtype_bytes, ep, hw)
    window = t.compute - t.routed - t.gate
    regular = 3 * t.compute + 2 * a2a
    farskip = 3 * t.compute + max(0.0, a2a - window) + max(0.0, a2a - 2 * window)
    return TrainingResult(tokens, a2a * 1e3, window * 1e3, regular * 1e3, farskip * 1e3)


def load_config(model: str | None = None, preset: str | None = None):
    """A transformers config from a hub id / local folder, or from an embedded preset (offline)."""
    from transformers import AutoConfig

    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)} or pass --model")
        values = dict(PRESETS[preset])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    from fcsd.loading import load_config as load_checkpoint_config
    from fcsd.sources import resolve_model

    return load_checkpoint_config(resolve_model(model))  # an unreadable config.json is a one-line error


PLOT_WRITER = "fcsd perfmodel"  # the PNG's Software text chunk: a later --plot replaces only such a file


def is_own_plot(path) -> bool:
    """A PNG ``fcsd perfmodel --plot`` wrote."""
    from fcsd.files.ownership import is_png_by

    return is_png_by(path, PLOT_WRITER)


def plot_sweep(rows: list[PrefillResult], path, title: str) -> None:
    """Figs. 9/11: speedup against sparsity, one line per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scenario in dict.fromkeys(r.scenario for r in rows):
        points = [(r.sparsity, r.speedup) for r in rows if r.scenario == scenario]
        # "2x compute + 2x comm" coincides with the baseline (App. B): dash it so both stay visible
        style = dict(linestyle="--", linewidth=2.5) if scenario == "2x_compute_2x_comm" else dict(linewidth=1.5)
        ax.plot(*zip(*points), marker="o", label=scenario, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r.sparsity for r in rows}), [f"{s}x" for s in sorted({r.sparsity for r in rows})])
    ax.set_xlabel("sparsity factor (routed experts / active routed experts)")
    ax.set_ylabel("FarSkip prefill speedup")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from fcsd.files.staging import atomic_file

    with atomic_file(Path(path)) as staging:  # a stop mid-write leaves the previous plot, not half of one
        fig.savefig(staging, format="png", dpi=120, metadata={"Software": PLOT_WRITER})
    plt.close(fig)


def format_report(rows: list[PrefillResult], training, batch: int, context: int, tp: int, ep: int, hw) -> str:
    """The text table of ``fcsd perfmodel``: prefill rows per sparsity and scenario, then the training estimate."""
    lines = [
        f"prefill, batch {batch} x {context} tokens, TP={tp} EP={ep}, {hw}",
        f"{'sparsity':>8} {'scenario':<20}{'regular ms':>12}{'farskip ms':>12}{'exposed reg':>12}"
        f"{'exposed far':>12}{'speedup':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.sparsity:>7}x {r.scenario:<20}{r.regular_ms:>12.1f}{r.farskip_ms:>12.1f}"
            f"{r.exposed_regular_ms:>12.1f}{r.exposed_farskip_ms:>12.1f}{r.speedup:>8.3f}x"
        )
    t = training
    lines.append(
        f"training, one MoE layer, {t.tokens_per_gpu} tokens/GPU, EP={ep}: dispatch+combine "
        f"{t.dispatch_combine_ms:.2f} ms vs Eq. 9 window {t.overlap_window_ms:.2f} ms; fwd+bwd regular "
        f"{t.regular_ms:.2f} ms, FarSkip {t.farskip_ms:.2f} ms ({t.speedup:.3f}x)"
    )
    return "\n".join(lines)
