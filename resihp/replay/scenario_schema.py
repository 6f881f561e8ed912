"""Every key of a replay scenario file, with its form, default and meaning.

It is the one list the loader checks keys against, ``docs/scenario.md`` and ``resihp replay
--schema`` are made from, and ``resihp replay --example`` writes a complete commented scenario
from."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class ScenarioKey:
    """One key of a section: its form, its default (None: required) and what it means."""

    name: str
    form: str
    default: str | None
    doc: str
    example: str = ""  # the value ``--example`` writes (default: the default)


@dataclass(frozen=True)
class ScenarioSection:
    """A top-level key of the scenario and, for a mapping, its keys."""

    name: str
    required: bool
    doc: str
    keys: tuple[ScenarioKey, ...] = ()
    form: str = "mapping"
    example: str = ""

    def names(self) -> set[str]:
        return {k.name for k in self.keys}


DURATION = "duration (3600, 90m, 12h, 9h30m, 7d)"

_K, _S = ScenarioKey, ScenarioSection  # short names for the table below

SECTIONS: tuple[ScenarioSection, ...] = (
    _S(
        "name",
        False,
        "The scenario's name in reports (default: the file's name).",
        form="string",
        example="example",
    ),
    _S(
        "family",
        False,
        "A label grouping scenarios in reports (fail-stop, fail-slow, mixed).",
        form="string",
        example="mixed",
    ),
    _S(
        "cluster",
        True,
        "Nodes of identical devices. The keys of the cluster files `resihp "
        "plan` reads (`bandwidth`, `device.tflops`, `nodes: {count, devices}` or a list of "
        "nodes) are accepted too: one form or the other, of identical nodes.",
        keys=(
            _K("nodes", "integer >= 1", None, "Number of nodes.", "2"),
            _K("gpus_per_node", "integer >= 1", None, "Devices per node.", "8"),
            _K(
                "device",
                "mapping",
                "{}",
                "The device: name, memory_gb, peak_tflops, mfu, hbm_gbps (below).",
                "see below",
            ),
            _K(
                "intra_node_gbps", "number > 0", "300", "Bandwidth between devices of a node, GB/s."
            ),
            _K("inter_node_gbps", "number > 0", "25", "Bandwidth between nodes, GB/s, per device."),
            _K("memory_reserve_gb", "number >= 0", "2", "Device memory kept free of model state."),
        ),
    ),
    _S(
        "cluster.device",
        False,
        "The cluster's device.",
        keys=(
            _K("name", "string", "A100-80GB", "The device's name, for the reader.", "H100-80GB"),
            _K(
                "type",
                "string",
                '""',
                "The kind of device as a predictor card names it (cuda:NVIDIA H100, cpu).",
                '"cuda:NVIDIA H100"',
            ),
            _K("memory_gb", "number > 0", "80", "Memory per device, GB."),
            _K("peak_tflops", "number > 0", "312", "Peak dense rate, TFLOP/s.", "989"),
            _K(
                "mfu",
                "number in (0, 1]",
                "0.5",
                "Share of the peak a training step sustains.",
                "0.4",
            ),
            _K(
                "hbm_gbps",
                "number > 0",
                "2039",
                "Memory bandwidth, GB/s (the optimizer's pace).",
                "3350",
            ),
        ),
    ),
    _S(
        "model",
        True,
        "The model and its batch (the planner's ModelSpec).",
        keys=(
            _K("name", "string", "model", "The model's name.", "llama-7b"),
            _K("layers", "integer >= 1", None, "Transformer layers.", "32"),
            _K("hidden", "integer >= 1", None, "Hidden size (a multiple of heads).", "4096"),
            _K("heads", "integer >= 1", None, "Attention heads.", "32"),
            _K("ffn_hidden", "integer >= 1", None, "MLP hidden size.", "11008"),
            _K("vocab", "integer >= 1", None, "Vocabulary size.", "32000"),
            _K("max_seq_len", "integer >= 1", None, "Longest sequence.", "4096"),
            _K(
                "global_batch_tokens",
                "integer >= 1",
                None,
                "Tokens per step, all replicas.",
                "1048576",
            ),
            _K(
                "microbatch_tokens",
                "integer >= max_seq_len",
                None,
                "Tokens per micro-batch.",
                "4096",
            ),
            _K("schedule", "1f1b", "1f1b", "Pipeline schedule (only 1f1b is replayed)."),
            _K("mlp", "gelu or swiglu", "gelu", "MLP kind (its matrices per layer).", "swiglu"),
        ),
    ),
    _S(
        "parallel",
        True,
        "The initial layout; dp x pp x tp devices of the cluster, tp within a node.",
        keys=(
            _K("dp", "integer >= 1", None, "Data-parallel replicas.", "2"),
            _K("pp", "integer >= 1", None, "Pipeline stages.", "1"),
            _K("tp", "integer >= 1", None, "Tensor-parallel size (divides gpus_per_node).", "8"),
        ),
    ),
    _S(
        "workload",
        True,
        "Where sequence lengths come from.",
        keys=(
            _K(
                "source",
                "code, text, changelog, alibaba or a lengths file",
                None,
                "The sequence-length source.",
                "text",
            ),
        ),
    ),
    _S("duration", True, "Wall-clock time replayed.", form=DURATION, example="2h"),
    _S(
        "costs",
        False,
        "Seconds lost to recovery work.",
        keys=(
            _K("restart", DURATION, "10m", "A job restart (checkpoint-restart policies)."),
            _K("checkpoint_interval", DURATION, "1h", "Time between checkpoints (> 0)."),
            _K("reconfig", DURATION, "1m", "A re-plan in place (resihp)."),
            _K("heartbeat_timeout", DURATION, "30s", "Until a stopped device is declared dead."),
            _K("repair", DURATION, "4h", "Until a stopped device is back."),
        ),
    ),
    _S(
        "events",
        False,
        "Failure events in time order: a list of mappings with `at`, "
        "exactly one of `device` or `node`, `kind`, and `factor` for slow and link.",
        keys=(
            _K("at", DURATION, None, "When (from the start; at most duration).", "30m"),
            _K("device", "integer >= 0", None, "A device's rank (or give node).", "3"),
            _K("node", "integer >= 0", None, "Every device of a node (or give device)."),
            _K(
                "kind",
                "slow, link, stop or recover",
                None,
                "slow: compute slowed by factor; link: "
                "its network transfers; stop: dead; recover: healthy again.",
                "slow",
            ),
            _K("factor", "number >= 1", "1", "How many times slower (slow, link).", "2.5"),
            _K("cause", "string", '""', "A label for reports."),
        ),
        form="list of mappings",
    ),
    _S(
        "generators",
        False,
        "Failure generators with their rates: a list of mappings with "
        "`kind` (llama3, greyhound, alibaba) and that generator's own parameters "
        "(greyhound: `communication`, the share of its fail-slows that are slow links).",
        keys=(_K("kind", "llama3, greyhound or alibaba", None, "The generator."),),
        form="list of mappings",
    ),
    _S(
        "noise",
        False,
        "Step-time noise.",
        keys=(
            _K(
                "alibaba_job",
                "integer >= 1",
                "2",
                "The Alibaba PAI job whose mini-batch times set the noise.",
            ),
        ),
    ),
    _S(
        "seed",
        False,
        "Seed of the generators, the workload and the noise.",
        form="integer",
        example="0",
    ),
    _S(
        "replay",
        False,
        "How the engine samples.",
        keys=(
            _K("window_steps", "integer >= 4", "32", "Steps simulated after each change."),
            _K("observe_steps", "integer >= 4", "96", "Steps the detector sees per window."),
            _K("probe_interval", DURATION, "6h", "Time between probe windows."),
            _K("ops_microbatches", "integer >= 1", "8", "Micro-batches in the ops trace per step."),
        ),
    ),
)

BY_NAME = {s.name: s for s in SECTIONS}
TOP_LEVEL = {s.name for s in SECTIONS if "." not in s.name}
# the cluster keys of the plan's cluster files (resihp.plan.specs.ClusterSpec.from_dict)
PLAN_CLUSTER_KEYS = {"name", "device", "bandwidth", "memory_reserve_gb", "nodes", "speeds", "links"}


def keys_of(section: str) -> set[str]:
    """The key names a section allows."""
    return BY_NAME[section].names()


def schema_markdown() -> str:
    """``docs/scenario.md``: every section and key, its form, default and meaning."""
    lines = [
        "# Replay scenario keys",
        "",
        "Generated by `resihp replay --schema` from `resihp/replay/scenario_schema.py`; "
        "`resihp replay --example` prints a complete commented scenario.",
        "",
    ]
    for s in SECTIONS:
        need = "required" if s.required else "optional"
        lines += [f"## `{s.name}` ({s.form}, {need})", "", s.doc, ""]
        if s.keys:
            lines += ["| key | form | default | meaning |", "|---|---|---|---|"]
            lines += [
                f"| `{k.name}` | {k.form} | {'required' if k.default is None else k.default}"
                f" | {k.doc} |"
                for k in s.keys
            ]
            lines.append("")
    return "\n".join(lines)


def _value(key: ScenarioKey) -> str:
    return key.example or (key.default if key.default is not None else "")


def example_yaml() -> str:
    """A complete scenario, every key written out with its meaning as a comment."""
    out = [
        "# A replay scenario: `resihp replay FILE`. Every key, its default and meaning:",
        "# docs/scenario.md (`resihp replay --schema`).",
    ]
    for s in SECTIONS:
        if s.name == "cluster.device":
            continue
        out += [f"# {line}" for line in textwrap.wrap(s.doc, 98)]
        if not s.keys:
            out.append(f"{s.name}: {s.example}")
        elif s.name == "events":
            out += [
                "events:",
                "  - {at: 30m, device: 3, kind: slow, factor: 2.5}  # device 3 at 2.5x",
                "  - {at: 40m, node: 1, kind: link, factor: 2, cause: switch}  # its links",
                "  - {at: 90m, device: 3, kind: recover}  # device 3 healthy again",
            ]
        elif s.name == "generators":
            out += ["# generators:", "#   - {kind: greyhound, communication: 0.3}"]
        else:
            out.append(f"{s.name}:")
            for k in s.keys:
                if k.name == "device" and s.name == "cluster":
                    out.append("  device:")
                    out += [
                        f"    {d.name}: {_value(d)}  # {d.doc}"
                        for d in BY_NAME["cluster.device"].keys
                        if _value(d)
                    ]
                    continue
                if _value(k):
                    out.append(f"  {k.name}: {_value(k)}  # {k.doc}")
    return "\n".join(out) + "\n"
