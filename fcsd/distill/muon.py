"""Muon on the student's hidden matrices, AdamW on the rest (issue 37 item 3, ``recovery.optimizer=muon``).

Muon (Jordan et al. 2024) replaces each matrix's momentum by its nearest semi-orthogonal matrix (five Newton-Schulz
iterations), so every direction of the update moves at the same rate; Moonlight (Liu et al. 2025, "Muon is Scalable
for LLM Training") scales the update to AdamW's RMS (``0.2 * sqrt(max(rows, cols))``) so that the two share one LR
and weight decay, and reports about twice AdamW's token efficiency in pre-training. torch's ``torch.optim.Muon``
takes 2-D matrices only; the experts of a Hugging Face MoE are stacked 3-D tensors (one matrix per expert), so this
module orthogonalises each expert's matrix in one batched iteration. Embeddings, the LM head, norms and biases stay
on AdamW (as in Moonlight).
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz coefficients


def orthogonalise(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix of each matrix in the last two dimensions of ``update`` (approximately:
    singular values in about [0.7, 1.2]), by the quintic Newton-Schulz iteration of Muon, batched over the leading
    dimensions (the experts)."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer for the whole student: groups with ``muon=True`` take Nesterov momentum orthogonalised by
    :func:`orthogonalise`, scaled to AdamW's update RMS (Moonlight), the others AdamW; both at the group's ``lr``
    (one LR schedule drives them) with decoupled ``weight_decay``."""

    def __init__(
        self, groups, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0, momentum: float = 0.95, eps: float = 1e-8
    ):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, momentum=momentum, eps=eps, muon=False)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                param.mul_(1 - lr * decay)
                if group["muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(param))
                    buf.lerp_(grad, 1 - group["momentum"])
                    update = orthogonalise(grad.lerp(buf, group["momentum"]))
                    param.add_(update, alpha=-lr * 0.2 * math.sqrt(max(param.shape[-2:])))
                    continue
                beta1, beta2 = group["betas"]
                if "exp_avg_sq" not in state:  # (the schedule-free wrapper keeps its own entries here too)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(param), torch.zeros_like(param)
                state["step"] += 1
                step = state["step"].item()
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))
        return loss


def muon_groups(student: torch.nn.Module, params: list) -> list[dict]:
    """``params`` (the trained parameters) split into Muon's groups (every matrix of the decoder layers: attention,
    router, experts, dense MLPs) and AdamW's (embeddings, LM head, norms, biases)."""
    from fcsd.distill.param_groups import parameter_groups

    group_of = parameter_groups(student)
    names = {id(p): name for name, p in student.named_parameters()}
    matrices = [p for p in params if p.ndim >= 2 and group_of[names[id(p)]] != "embeddings"]
    chosen = {id(p) for p in matrices}
    rest = [p for p in params if id(p) not in chosen]
    return [g for g in ({"params": matrices, "muon": True}, {"params": rest, "muon": False}) if g["params"]]


def schedule_free_muon(student, params, lr: float, warmup: int, train):
    """Muon (and AdamW's second moments on the rest) made schedule-free by ``schedulefree.ScheduleFreeWrapper``: the
    base takes no momentum of its own (the wrapper's interpolation is the momentum), the average is scored and
    saved as :func:`fcsd.distill.optim.schedule_free`'s."""
    import schedulefree

    from fcsd.distill.optim import LinearWarmup

    base = MuonAdamW(muon_groups(student, params), lr=lr, betas=(0.0, train.adam_betas[1]), momentum=0.0)
    optimizer = schedulefree.ScheduleFreeWrapper(
        base, momentum=train.adam_betas[0], weight_decay_at_y=train.weight_decay
    )
    optimizer.train()
    return optimizer, torch.optim.lr_scheduler.LambdaLR(base, LinearWarmup(warmup))
