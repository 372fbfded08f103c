"""The time model of one candidate search (paper Sec. 4.1 / Eq. 9): each candidate's
:class:`fcsd.plan.timing.StepTime`, the routing reach of each EP size spanning nodes (:mod:`fcsd.plan.routing`,
computed once), and a lower bound of a layout's step that needs no simulation, which lets the search skip the
strategies that cannot be fastest (:mod:`fcsd.plan.candidates`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fcsd.plan.cluster import Cluster
from fcsd.plan.run import Layout, accumulation_steps


@dataclass
class Pricing:
    """The time model of one search: a candidate's :class:`fcsd.plan.timing.StepTime` and a lower bound of it that
    needs no simulation; the routing reach of each EP size computed once."""

    model_config: object
    fcsd_config: object
    cluster: Cluster
    counts: object  # candidates.Counts
    shape: object
    converted: set
    reaches: dict = field(default_factory=dict)

    def reach(self, ep: int):
        if ep <= self.cluster.gpus_per_node:
            return None
        if ep not in self.reaches:
            from fcsd.plan.routing import model_reach

            self.reaches[ep] = model_reach(self.shape, self.model_config, ep, self.cluster.gpus_per_node)
        return self.reaches[ep]

    def time(self, estimate):
        from fcsd.plan.timing import step_time

        config = self.fcsd_config
        return step_time(
            estimate,
            self.shape,
            self.converted,
            self.cluster,
            config.train.batch_tokens,
            config.data.seq_len,
            self.counts,
            self.reach(estimate.layout.ep_size),
        )

    def host_scale(self, layout: Layout) -> float:
        """:func:`fcsd.plan.timing.replay_scale` of ``layout``."""
        from fcsd.plan.timing import replay_scale

        return replay_scale(layout, self.cluster, self.reach(layout.ep_size))

    def bound(self, layout: Layout) -> float:
        """:func:`step_bound` of ``layout``."""
        return step_bound(layout, self)


def step_bound(layout: Layout, pricing: Pricing) -> float:
    """A lower bound of ``layout``'s step time from the config alone: the all-to-alls nothing hides (the regular
    layers', the teacher's, the fan-out inside nodes, what exceeds the FarSkip window) plus FSDP2's collectives,
    which can hide behind the compute but not make the step shorter than themselves
    (``compute + max(0, gathers - compute) >= gathers``)."""
    from fcsd.plan.timing import ep_breakdown, fsdp_parts

    cluster, config = pricing.cluster, pricing.fcsd_config
    tokens = config.train.batch_tokens // layout.processes
    bound = 0.0
    if layout.ep_size > 1:
        online = layout.teacher == "online"
        args = (pricing.shape, pricing.converted, tokens, config.data.seq_len, layout.ep_size, cluster, online)
        bound += ep_breakdown(*args, pricing.reach(layout.ep_size)).total
    if layout.fsdp:
        bound += sum(fsdp_parts(layout, pricing.counts, cluster, accumulation_steps(config, layout)))
    return bound
