"""FarSkip rewiring: equations against the hand-written reference, bit-exact restore, and the model features that
must keep working with the patch on (generation, gradients, checkpointing, hidden states, router logits)."""

import accelerate.hooks
import pytest
import torch
import transformers
from reference import causal_lm, decoder_layers, farskip_reference, is_moe, mlp_of
from tiny_models import CONFIGS, TEXT_FAMILIES, build

import fcsd
from fcsd.connectivity import UnsupportedModelError
from fcsd.connectivity.patch import FarSkipLayerMixin

ALL_FAMILIES = list(CONFIGS)


def ids_for(model, batch=2, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, causal_lm(model).config.vocab_size, (batch, length), generator=gen)


def logits(model, input_ids, **kwargs):
    return causal_lm(model)(input_ids=input_ids, **kwargs).logits


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("spec", ["all", "last:50%", "first:1", [0, 2]])
def test_logits_match_reference_equations(family, spec):
    model = build(family)
    ids = ids_for(model)
    converted = fcsd.parse_layer_spec(spec, len(decoder_layers(model)))
    expected, _, _ = farskip_reference(model, ids, set(converted))
    fcsd.apply_farskip(model, spec)
    assert fcsd.farskip_layers(model) == converted
    with torch.no_grad():
        got = logits(model, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the rewiring really changes the function (otherwise the comparison above proves nothing)
    fcsd.remove_farskip(model)
    with torch.no_grad():
        assert (logits(model, ids) - got).abs().max() > 1e-4


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_no_layer_and_remove_are_bit_identical_to_stock(family):
    model = build(family)
    ids = ids_for(model)
    with torch.no_grad():
        stock = logits(model, ids)
        fcsd.apply_farskip(model, "none")
        assert fcsd.farskip_layers(model) == []
        assert torch.equal(logits(model, ids), stock)
        fcsd.apply_farskip(model, "all")
        fcsd.remove_farskip(model)
        assert fcsd.farskip_layers(model) == []
        assert not hasattr(model.config, "farskip")
        assert torch.equal(logits(model, ids), stock)
    assert not any(isinstance(layer, FarSkipLayerMixin) for layer in decoder_layers(model))


def test_apply_keeps_weights_and_state_dict_keys():
    model = build("deepseek_v3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fcsd.apply_farskip(model, "all")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reapply_replaces_selection():
    model = build("qwen3_moe")
    fcsd.apply_farskip(model, "all")
    fcsd.apply_farskip(model, "first:1")
    assert fcsd.farskip_layers(model) == [0]
    assert model.config.farskip["layers"] == [0]


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_greedy_generation_with_cache_matches_full_forward(family):
    model = build(family)
    fcsd.apply_farskip(model, "all")
    prompt = ids_for(model, batch=2, length=5)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        full = model(input_ids=out).logits
    expected_next = full[:, prompt.shape[1] - 1 : -1].argmax(-1)
    assert torch.equal(out[:, prompt.shape[1] :], expected_next)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "llama4_text"])
def test_incremental_decoding_logits_match_full_forward(family):
    model = build(family)
    fcsd.apply_farskip(model, "last:50%")
    ids = ids_for(model, batch=1, length=10)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = transformers.DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :4], cache=cache, use_cache=True).logits]
        for t in range(4, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def _grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = causal_lm(model)(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_gradients_reach_every_parameter(family):
    model = build(family).train()
    fcsd.apply_farskip(model, "all")
    ids = ids_for(model, batch=4, length=32)
    _, grads = _grads(model, ids)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == grads.keys(), f"no gradient for {sorted(names - grads.keys())}"
    assert all(torch.isfinite(g).all() for g in grads.values())
    zero = [n for n, g in grads.items() if not g.any()]
    assert not zero, f"zero gradient for {zero}"


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe", "llama4_text"])
def test_gradient_checkpointing_gives_same_loss_and_gradients(family, use_reentrant):
    model = build(family).train()
    fcsd.apply_farskip(model, "last:50%")
    ids = ids_for(model, batch=2, length=16)
    loss, grads = _grads(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if use_reentrant:
        model.enable_input_require_grads()
    loss_ckpt, grads_ckpt = _grads(model, ids)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("converted", [[1, 2], "all"])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "llama4_text", "mixtral"])
def test_hidden_states_are_the_full_stream(family, converted):
    """Every entry: after each layer the full stream o_k (the last converted layer too, also the model's last layer
    when all are converted), and the final entry the final norm of the last o."""
    model = build(family)
    ids = ids_for(model)
    layers = set(range(len(decoder_layers(model)))) if converted == "all" else set(converted)
    _, fulls, _ = farskip_reference(model, ids, layers)
    fcsd.apply_farskip(model, converted)
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(states) == len(fulls) + 1
    for k in range(len(fulls) - 1):
        torch.testing.assert_close(states[k + 1], fulls[k], rtol=1e-5, atol=1e-5)
    final = causal_lm(model).model.norm(fulls[-1])  # transformers reports the last one after the final norm
    torch.testing.assert_close(states[-1], final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_router_logits_and_aux_loss(family):
    """Router logits of every MoE layer as the reference computes them, and the load-balancing loss the family's
    own function gives on those logits (families that have one)."""
    import sys

    model = build(family)
    ids = ids_for(model)
    _, _, expected = farskip_reference(model, ids, {0, 1, 2})
    fcsd.apply_farskip(model, "0-2")
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
    n_moe = sum(is_moe(mlp_of(layer)) for layer in decoder_layers(model))
    assert len(out.router_logits) == n_moe == len(expected)
    for got, want in zip(out.router_logits, expected):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    balance = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if balance is not None and getattr(out, "aux_loss", None) is not None:
        config = model.config
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        want = balance(tuple(expected), num_experts, config.num_experts_per_tok, None)
        assert float(out.aux_loss) > 0
        torch.testing.assert_close(out.aux_loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "llama4_text"])
def test_bf16_matches_fp32_closely(family):
    model = build(family)
    ids = ids_for(model)
    fcsd.apply_farskip(model, "all")
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        model.to(torch.bfloat16)
        got = model(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_llama4_multimodal_text_tower_is_converted():
    model = build("llama4_multimodal")
    fcsd.apply_farskip(model, "all")
    assert fcsd.farskip_layers(model) == [0, 1, 2, 3]
    assert all(not type(layer).__name__.startswith("FarSkip") for layer in model.vision_model.model.layers)


def test_accelerate_device_hooks_follow_the_class_swap():
    model = build("qwen3_moe")
    ids = ids_for(model)
    fcsd.apply_farskip(model, "all")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    fcsd.remove_farskip(model)
    for layer in decoder_layers(model):  # hooks added before conversion, as device_map loading does
        accelerate.hooks.add_hook_to_module(layer, accelerate.hooks.ModelHook())
    fcsd.apply_farskip(model, "all")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_save_and_from_pretrained_restore_the_connectivity(tmp_path):
    model = build("deepseek_v3")
    ids = ids_for(model)
    fcsd.apply_farskip(model, "last:2")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = fcsd.from_pretrained(str(tmp_path), attn_implementation="eager")
    assert fcsd.farskip_layers(loaded) == [2, 3]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected)
    assert fcsd.farskip_layers(fcsd.from_pretrained(str(tmp_path), layers="none")) == []


def test_unsupported_model_lists_supported_families():
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    with pytest.raises(UnsupportedModelError, match=r"'llama'.*DeepSeek-V2.*Qwen3-MoE.*Llama-4.*Mixtral"):
        fcsd.apply_farskip(transformers.LlamaForCausalLM(config))


def test_bad_layer_spec_errors_are_explicit():
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="grammar"):
        fcsd.apply_farskip(model, "last-2")
    with pytest.raises(ValueError, match="has 4 layers"):
        fcsd.apply_farskip(model, "0,7")
    assert fcsd.farskip_layers(model) == []
