"""Resharding benchmark: a checkpoint written at one layout loaded into others from disk (the path
``resihp run --resume`` takes), at the runtime's default model and at one with >= 256 MiB of state
(parameters and AdamW moments) per rank. Two ranks spawned on gloo; every target layout's engine
is built once and reloaded in interleaved rounds; medians. Per transition: wall time of the load
(the slowest rank; it includes checking every file against the manifest, timed alone as
``verify_s``), bytes DCP read versus the minimum (each rank's own blocks: its shards and its copies
of replicated tensors). From memory (``from_memory``): live layout changes of the running engine
(``Engine.sync_plan`` with a layout: new process groups, state resharded through shared memory)
to each target and back: seconds (the slowest rank), bytes moved (written + read) versus the least
the two layouts need (what each rank did not hold before), and at the default model the stall in
steps (seconds over the median step time). Prints JSON; ``--out`` also writes it.

    OMP_NUM_THREADS=1 python benchmarks/reshard.py [--quick] [--out benchmarks/results/reshard.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
SAVED = {"dp": 1, "pp": 1, "tp": 2}
TARGETS = {
    "1x1x2 (same)": {"dp": 1, "pp": 1, "tp": 2},
    "2x1x1": {"dp": 2, "pp": 1, "tp": 1},
    "1x2x1": {"dp": 1, "pp": 2, "tp": 1},
}
MODELS = {
    "default": {},  # the runtime's default model (RunConfig)
    "large": {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 4096, "vocab": 8192},
}


def _state_bytes(engine) -> int:
    from resihp.ckpt.reshard import local_blocks, placed_state

    blocks = local_blocks(placed_state(engine.model, engine.optimizer, engine.tp, engine.model_cfg))
    return sum(t.numel() * t.element_size() for t in blocks.values())


def _counting_reader(directory: Path, counter: list[int]):
    from resihp.ckpt.integrity import safe_reader
    from resihp.ckpt.reshard import counting_reader

    return counting_reader(safe_reader(directory), counter)


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum(value: int) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t)


def _from_memory(engine, rounds: int, time_steps: bool) -> dict:
    """Live layout changes (no restart): from the saved layout to each other target and back, in
    rotated order; per direction the slowest rank's seconds, bytes moved and the least needed. At
    the default model also the step time, to give the stall in steps."""
    step_s = []
    if time_steps:
        for s in range(3):
            step_s.append(_max(engine.train_step(s).wall_s))
    out: dict[str, dict[str, list]] = {}
    version = engine.plan_version
    names = [t for t in TARGETS if TARGETS[t] != SAVED]
    for i in range(rounds):
        for t in names[i % len(names) :] + names[: i % len(names)]:
            for label, layout in ((f"1x1x2 -> {t}", TARGETS[t]), (f"{t} -> 1x1x2", SAVED)):
                version += 1
                engine.sync_plan(
                    0, {"version": version, "layout": layout} if dist.get_rank() == 0 else None
                )
                change = engine.plan_changes[-1]
                row = out.setdefault(
                    label, {"relayout_s": [], "moved_bytes": [], "minimum_bytes": []}
                )
                for k in row:
                    row[k].append(change[k])
    result = {}
    for label, row in out.items():
        seconds = statistics.median(row["relayout_s"])
        result[label] = {
            "relayout_s": seconds,
            "relayout_s_all": row["relayout_s"],
            "moved_bytes": row["moved_bytes"][0],
            "minimum_bytes": row["minimum_bytes"][0],
            # None where the layouts need nothing moved (every rank held its new blocks)
            "moved_over_minimum": (
                row["moved_bytes"][0] / row["minimum_bytes"][0] if row["minimum_bytes"][0] else None
            ),
        }
        if step_s:
            result[label]["stall_steps"] = seconds / statistics.median(step_s)
    return {"step_s": statistics.median(step_s) if step_s else None, "changes": result}


def _rank(rank: int, tmp: str, rounds: int, models: list[str]) -> None:
    from resihp.ckpt.integrity import verify
    from resihp.ckpt.universal import load, save
    from resihp.train.config import RunConfig
    from resihp.train.elastic import checkpoint_meta
    from resihp.train.engine import Engine

    result: dict = {"models": {}}
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(tmp, "store"), WORLD),
            rank=rank,
            world_size=WORLD,
        )
        for name in models:
            shape = MODELS[name]
            saved = Path(tmp) / name
            cfg = RunConfig.from_flags(**shape, **SAVED, out=tmp)
            engine = Engine(cfg, torch.device("cpu"))
            saves = []
            for i in range(rounds):
                dist.barrier()
                t0 = time.perf_counter()
                save(
                    saved / f"r{i}",
                    engine.model,
                    engine.optimizer,
                    0,
                    checkpoint_meta(engine, cfg),
                    engine.tp,
                    engine.model_cfg,
                )
                saves.append(_max(time.perf_counter() - t0))
            state_bytes = _max(_state_bytes(engine))
            memory = _from_memory(engine, rounds, name == "default")
            del engine
            engines = {
                t: Engine(RunConfig.from_flags(**shape, **layout, out=tmp), torch.device("cpu"))
                for t, layout in TARGETS.items()
            }
            times = {t: [] for t in TARGETS}
            verifies, read, minimum = [], {}, {}
            for i in range(rounds):
                names = list(TARGETS)
                for t in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
                    engine = engines[t]
                    counter = [0]
                    dist.barrier()
                    t0 = time.perf_counter()
                    load(
                        saved / f"r{i}",
                        engine.model,
                        engine.optimizer,
                        engine.tp,
                        engine.model_cfg,
                        reader=_counting_reader(saved / f"r{i}", counter),
                    )
                    times[t].append(_max(time.perf_counter() - t0))
                    read[t], minimum[t] = _sum(counter[0]), _sum(_state_bytes(engine))
                dist.barrier()
                t0 = time.perf_counter()
                verify(saved / f"r{i}")
                verifies.append(_max(time.perf_counter() - t0))
            result["models"][name] = {
                "shape": RunConfig.from_flags(**shape).model.to_dict(),
                "saved_layout": SAVED,
                "state_bytes_per_rank": int(state_bytes),
                "save_s": statistics.median(saves),
                "verify_s": statistics.median(verifies),
                "from_memory": memory,
                "transitions": {
                    t: {
                        "layout": TARGETS[t],
                        "load_s": statistics.median(times[t]),
                        "load_s_all": times[t],
                        "bytes_read": read[t],
                        "bytes_minimum": minimum[t],
                        "read_over_minimum": read[t] / minimum[t],
                    }
                    for t in TARGETS
                },
            }
            del engines
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 5")
    parser.add_argument("--models", default="default,large")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rounds = 3 if args.quick else 5
    models = args.models.split(",")
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(
            _rank, args=(tmp, rounds, models), nprocs=WORLD, join=True, start_method="spawn"
        )
        results = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        if "error" in res:
            raise SystemExit(f"rank {r}:\n{res['error']}")
    report = {
        "benchmark": "reshard",
        "world": WORLD,
        "rounds": rounds,
        "models": results[0]["models"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "wall_s": round(time.time() - started, 1),
        "note": "from disk, through the page cache (files just written); load_s includes each rank "
        "checking every file's sha256 against the manifest (verify_s alone)",
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
