"""A pipeline schedule as a networkx DAG and its critical path.

For explaining and checking a step's time (``resihp.perf.schedule`` computes the same times
vectorised, without networkx, for the hot path and for the runtime's workers, which never import
this)."""

from __future__ import annotations

import networkx as nx
import numpy as np

from resihp.perf.schedule import FWD, CompiledSchedule, node_durations


def schedule_graph(
    sched: CompiledSchedule, fwd: np.ndarray, bwd: np.ndarray, p2p_s: float = 0.0
) -> nx.DiGraph:
    """The schedule as a networkx DAG, for explaining and checking (not for the hot path).

    Node weights are durations, edge weights transfer times; node names are (phase, chunk, mb).

    Args:
        sched: the compiled schedule.
        fwd: forward seconds, [model chunks, micro-batches].
        bwd: backward seconds, the same shape.
        p2p_s: seconds of each transfer between pipeline ranks.
    """
    dur = node_durations(sched, np.asarray(fwd, np.float64), np.asarray(bwd, np.float64))
    graph = nx.DiGraph()
    names = [
        ("F" if ph == FWD else "B", int(c), int(j))
        for ph, c, j in zip(sched.phase, sched.chunk, sched.mb)
    ]
    for i, name in enumerate(names):
        graph.add_node(name, duration=float(dur[i]), rank=int(sched.rank[i]))
    for i in range(sched.nodes):
        if sched.prev_same[i] < sched.nodes:
            graph.add_edge(names[sched.prev_same[i]], names[i], transfer=0.0)
        if sched.prev_dep[i] < sched.nodes:
            graph.add_edge(
                names[sched.prev_dep[i]], names[i], transfer=p2p_s if sched.dep_is_p2p[i] else 0.0
            )
    return graph


def critical_path(graph: nx.DiGraph) -> tuple[float, list]:
    """Length and nodes of the longest path (node durations plus edge transfers)."""
    weighted = nx.DiGraph()
    for u, v, data in graph.edges(data=True):
        weighted.add_edge(u, v, weight=graph.nodes[u]["duration"] + data["transfer"])
    for node in graph.nodes:
        weighted.add_edge(node, "end", weight=graph.nodes[node]["duration"])
    path = nx.dag_longest_path(weighted, weight="weight")
    return nx.dag_longest_path_length(weighted, weight="weight"), path[:-1]
