"""Node-aware dispatch: a token's rows cross each node boundary once (design §4 "EP across nodes"; DeepEP's normal
mode, DeepSeek-V3's node-limited routing).

An expert-parallel group of ``P`` consecutive ranks spans ``N = P / L`` nodes of ``L`` ranks. Two process groups
per rank cut it the two ways: its **node** (the ``L`` ranks of its node) and its **rail** (the ``N`` ranks with its
position inside their nodes, one per node: rail rank ``j`` is on node ``j``). A MoE layer moves its rows in two hops:

1. **across nodes, over the rail**: one row per (token, destination node), the token's hidden state, with one fp32
   ``(weight, expert id inside that node)`` pair per (token, expert) there, to the rail peer on that node (the
   *forwarder*): a token whose ``k`` experts sit on ``g`` nodes sends ``g`` rows where the plain dispatcher sends up
   to ``k``;
2. **inside the node, over the node group**: the forwarder fans each row out, one row per destination rank of its
   node, with that rank's pairs (the deduplicated format of
   :class:`~fcsd.parallel.dispatchers.DedupAllToAllDispatcher`).

The combine runs back the same way: each receiving rank sums a row's weighted expert outputs in fp32 into one
partial sum per row, the forwarder adds the partial sums of its node's ranks per row (fp32, then rounded once to the
wire dtype) before it crosses back, and the token's rank adds one partial sum per node. Outputs and gradients equal
the plain dispatcher's (the same expert inputs, the same weights; fp32 sums in fixed slots, so deterministic).

Overlap: the node-crossing hops are the asynchronous ones, which the FarSkip schedule hides (the Dispatch across nodes
runs from ``dispatch_async`` to ``wait``, the Combine across nodes from ``combine_async`` to ``wait``); the fan-out
inside the node is issued and waited inside ``wait`` (the dispatch's) and ``combine_async`` (the combine's), on the
node's fast links. One host synchronisation per layer: every sender counts, per destination rank, the rows and pairs
of both hops; the rail's counts exchange tells each forwarder what it will fan out, a second counts exchange inside
the node tells each rank what it will receive, and all sizes are read back in one copy.

Seam for node-aware kernels (DeepEP-style fused forwarding): the two hops are the methods :meth:`_cross_nodes` and
:meth:`_fan_out`; an implementation that fuses them keeps the interface and the counters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fcsd.parallel.collectives import Exchange, exchange_counts, launch_all_to_all, received, wait_all_to_all
from fcsd.parallel.dispatchers import (
    CollectiveDispatcher,
    DispatchedRows,
    Pending,
    expand_rows,
    item_of_row,
    marked_pairs,
    row_partials,
    rows_by_destination,
    slot_sum,
    wire_dtype,
)
from fcsd.parallel.groups import new_group
from fcsd.placement.stats import ID_BYTES, WEIGHT_BYTES

PAIR_BYTES = ID_BYTES + WEIGHT_BYTES


class _Sizes(NamedTuple):
    """Host split sizes of one layer: across nodes (per node of the rail) and inside the node (per node rank)."""

    rows_out: list
    pairs_out: list
    rows_in: list
    pairs_in: list
    fan_rows_out: list
    fan_pairs_out: list
    fan_rows_in: list
    fan_pairs_in: list


class _State(NamedTuple):
    token_of_row: torch.Tensor  # (S,) the token each row sent across nodes came from
    num_tokens: int
    top_k: int
    out_dtype: torch.dtype
    sizes: _Sizes
    crossing: tuple  # (rows, pairs) exchanges over the rail
    received: dict  # filled by wait(): the fan-out's exchanges and the receiver's rows


@dataclass
class HierarchicalDispatcher(CollectiveDispatcher):
    """The node-aware dispatcher (module docstring): ``group`` the expert-parallel group, ``node_group`` and
    ``rail_group`` its two cuts (:func:`node_and_rail_groups`), ``node_size`` ranks per node."""

    node_group: Any = None
    rail_group: Any = None

    def _nodes(self) -> tuple[int, int]:
        return dist.get_world_size(self.rail_group), dist.get_world_size(self.node_group)

    def _exchange_in(self, group, send_sizes, recv_sizes, kind: str, replayed: bool = True) -> Exchange:
        exchange = Exchange(send_sizes, recv_sizes, group, sync=self._sync(), kind=kind, serial=self._next())
        exchange.replayed = replayed
        return exchange

    def _layer_sizes(self, node_dest, node_first, rank_dest, rank_first) -> _Sizes:
        """Every split size of the layer, from each pair's destination node and rank (and the marks on the first
        pair of each row): two counts exchanges, one device-to-host copy."""
        nodes, per_node = self._nodes()
        device = node_dest.device
        ones = torch.ones_like(node_dest)
        across = torch.zeros(nodes, 2, dtype=torch.int64, device=device)
        across[:, 0].scatter_add_(0, node_dest, node_first.long())
        across[:, 1].scatter_add_(0, node_dest, ones)
        per_rank = torch.zeros(nodes * per_node, 2, dtype=torch.int64, device=device)
        per_rank[:, 0].scatter_add_(0, rank_dest, rank_first.long())
        per_rank[:, 1].scatter_add_(0, rank_dest, ones)
        # per destination node: [rows, pairs] across, then what its forwarder fans out to each of its ranks
        send = torch.cat([across, per_rank.view(nodes, per_node * 2)], dim=1)
        recv = exchange_counts(send.reshape(-1), self.rail_group, self._next()).view(nodes, 2 + 2 * per_node)
        fan_out = recv[:, 2:].view(nodes, per_node, 2).sum(dim=0)  # (node rank, [rows, pairs]) this forwarder sends
        fan_in = exchange_counts(fan_out.reshape(-1), self.node_group, self._next()).view(per_node, 2)
        flat = torch.cat([across.t().reshape(-1), recv[:, :2].t().reshape(-1), fan_out.t().reshape(-1)])
        host = torch.cat([flat, fan_in.t().reshape(-1)]).tolist()  # the layer's one device-to-host copy
        cuts, start = [], 0
        for length in [nodes] * 4 + [per_node] * 4:  # the fields of _Sizes, in order
            cuts.append(host[start : start + length])
            start += length
        return _Sizes(*cuts)

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        _nodes, per_node = self._nodes()
        num_tokens, top_k = topk_ids_TK.shape
        local = self.num_local_experts
        flat_ids = topk_ids_TK.reshape(-1)
        owner = flat_ids // local
        token = torch.arange(num_tokens, device=x_TD.device).repeat_interleave(top_k, output_size=flat_ids.numel())
        order, node_sorted, token_sorted, first = rows_by_destination(owner // per_node, token, num_tokens)
        _, rank_sorted, _, rank_first = rows_by_destination(owner, token, num_tokens)
        sizes = self._layer_sizes(node_sorted, first, rank_sorted, rank_first)
        self._received(sum(sizes.fan_rows_in))
        token_of_row = item_of_row(first, token_sorted, sum(sizes.rows_out))
        node_ids = flat_ids[order] % (local * per_node)  # the expert's id inside its node
        pairs_A2 = marked_pairs(topk_weights_TK.reshape(-1)[order], node_ids, first)
        chain = self._chain(needs_backward)
        crossing = self._cross_nodes(x_TD.to(wire_dtype(x_TD))[token_of_row], pairs_A2, sizes, chain)
        state = _State(token_of_row, num_tokens, top_k, x_TD.dtype, sizes, crossing, {})

        def wait() -> DispatchedRows:
            rows_RD = wait_all_to_all(received(crossing[0]), crossing[0])
            pairs = wait_all_to_all(received(crossing[1]), crossing[1])
            return self._fan_out(rows_RD, pairs, state, chain, scale_inputs)

        return Pending(wait, state)

    def _cross_nodes(self, rows_RD, pairs_A2, sizes: _Sizes, chain) -> tuple:
        """Hop 1: launch the rows and their pairs to the rail peers (one per destination node). The rows only build
        the fan-out's sends: a checkpointed layer's replay keeps their shape, not them (the pairs, which say where
        the fan-out goes, it keeps)."""
        rows = self._exchange_in(self.rail_group, sizes.rows_out, sizes.rows_in, "dispatch", replayed=False)
        pairs = self._exchange_in(self.rail_group, sizes.pairs_out, sizes.pairs_in, "ids")
        launch_all_to_all(rows_RD, rows, chain)
        launch_all_to_all(pairs_A2, pairs, chain)
        row_bytes = rows_RD.shape[1] * rows_RD.element_size()
        self._count_sizes(sizes.rows_out, row_bytes, True, sizes.pairs_out, PAIR_BYTES, self.rail_group, _rail_node)
        return rows, pairs

    def _fan_out(self, rows_RD, pairs_A2, state: _State, chain, scale_inputs) -> DispatchedRows:
        """Hop 2, at the forwarder: one row per (received row, destination rank of this node) with that rank's
        pairs, exchanged inside the node; returns this rank's expert-major rows."""
        sizes, local = state.sizes, self.num_local_experts
        ids = pairs_A2[:, 1].detach()
        starts = ids < 0
        node_ids = torch.where(starts, -ids - 1, ids).long()
        row_of_pair = torch.cumsum(starts, 0) - 1
        order, _, row_sorted, first = rows_by_destination(node_ids // local, row_of_pair, rows_RD.shape[0])
        source_row = item_of_row(first, row_sorted, sum(sizes.fan_rows_out))
        fan_pairs = marked_pairs(pairs_A2[order, 0], node_ids[order] % local, first)
        rows = self._exchange_in(self.node_group, sizes.fan_rows_out, sizes.fan_rows_in, "dispatch")
        pairs = self._exchange_in(self.node_group, sizes.fan_pairs_out, sizes.fan_pairs_in, "ids")
        sent = rows_RD[source_row]
        launch_all_to_all(sent, rows, chain)
        launch_all_to_all(fan_pairs, pairs, chain)
        row_bytes = sent.shape[1] * sent.element_size()
        self._count_sizes(sizes.fan_rows_out, row_bytes, True, sizes.fan_pairs_out, PAIR_BYTES, self.node_group, _same)
        mine = wait_all_to_all(received(rows), rows)
        my_pairs = wait_all_to_all(received(pairs), pairs)
        expanded, got = expand_rows(mine, my_pairs, scale_inputs)
        state.received.update(got, fan=rows, source_row=source_row, forwarded=rows_RD.shape[0])
        return expanded

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        state: _State = pending.state
        pending.wait()
        got, (nodes, per_node) = state.received, self._nodes()
        fan = got["fan"]
        partial = row_partials(y_RD, got, min(state.top_k, self.num_local_experts))
        # inside the node, waited at once; its sums only build the way home's sends: not kept for a replay
        back = self._exchange_in(self.node_group, fan.recv_sizes, fan.send_sizes, "combine", replayed=False)
        launch_all_to_all(partial, back, fan.chain, wait_after=fan)
        row_bytes = partial.shape[1] * partial.element_size()
        self._count_sizes(back.send_sizes, row_bytes, group=self.node_group, node_of=_same)
        node_sums = wait_all_to_all(received(back), back)
        width = min(state.top_k, per_node)  # most ranks of a node one row reaches
        crossing = state.crossing[0]
        summed = slot_sum(node_sums, got["source_row"], got["forwarded"], width).to(node_sums.dtype)
        home = self._exchange_in(self.rail_group, crossing.recv_sizes, crossing.send_sizes, "combine")
        launch_all_to_all(summed, home, crossing.chain, wait_after=crossing)
        self._count_sizes(home.send_sizes, row_bytes, group=self.rail_group, node_of=_rail_node)

        def wait() -> torch.Tensor:
            rows = wait_all_to_all(received(home), home)
            width = min(state.top_k, nodes)  # most nodes one token reaches
            return slot_sum(rows, state.token_of_row, state.num_tokens, width).to(state.out_dtype)

        return Pending(wait)


def _rail_node(rank: int) -> int:
    return rank  # rail rank j sits on node j


def _same(rank: int) -> int:
    return 0  # every rank of a node group shares the node


def _node_of_rank() -> str:
    """This process's node: the launcher's node rank (``GROUP_RANK``), else the host name."""
    import socket

    return os.environ.get("GROUP_RANK") or socket.gethostname()


def _span(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def agreed_node_size(every: list, group_size: int) -> None:
    """Refuse, in one line, ranks that took different node sizes (``every``: per rank ``(node, its processes, the
    node size it took)``): each would create other node and rail groups, and all would wait in them forever."""
    taken = sorted({size for _node, _local, size in every})
    if len(taken) == 1:
        return
    nodes: dict = {}
    for rank, (node, local, _size) in enumerate(every):
        nodes.setdefault(node, (local, []))[1].append(rank)
    described = ", ".join(f"node {node} ({_span(ranks)}): {local}" for node, (local, ranks) in nodes.items())
    fits = [
        size for size in sorted({local for local, _ranks in nodes.values()}, reverse=True) if group_size % size == 0
    ]
    suggestion = fits[0] if fits else "N"
    raise ValueError(
        f"parallel.dispatcher=hierarchical: the nodes differ in processes per node ({described}), so the ranks "
        f"disagree on the node size ({' vs '.join(map(str, taken))}): set parallel.node_size={suggestion} for every "
        "node (the same on all; it must divide parallel.ep_size)"
    )


def node_and_rail_groups(group, node_size: int) -> tuple:
    """This rank's node group and rail group inside expert-parallel ``group`` (``None``: the whole job) of
    consecutive-rank nodes of ``node_size``. Every rank of the job creates every such group, in the same order (torch
    requires it): each rank's group membership and node size are shared first with one object collective, a
    disagreement refused (:func:`agreed_node_size`); the groups wait at most the default group's timeout."""
    mine = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or node_size)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, _node_of_rank(), local, node_size))
    agreed_node_size([entry[1:] for entry in every], len(mine))
    groups = sorted({tuple(entry[0]) for entry in every})
    found = {}
    for ranks in groups:
        nodes = [ranks[start : start + node_size] for start in range(0, len(ranks), node_size)]
        rails = [ranks[position::node_size] for position in range(node_size)]
        for kind, cuts in (("node", nodes), ("rail", rails)):
            for cut in cuts:
                created = new_group(list(cut))  # high priority, the run's timeout: as the expert-parallel group
                if dist.get_rank() in cut:
                    found[kind] = created
    return found["node"], found["rail"]
