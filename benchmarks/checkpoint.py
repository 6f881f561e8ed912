"""Checkpoint benchmark: the memory tier (``resihp.ckpt.snapshot``) against synchronous
``torch.distributed.checkpoint`` saves and cold-cache loads, on one training loop with at least
256 MiB of state per rank (parameters and AdamW moments). Prints JSON.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint.py [--quick]
        [--out benchmarks/results/checkpoint.json]

Arms, interleaved in rounds (each round runs every arm for ``--steps`` steps, in a rotated order,
so the shared machine's drifts hit all alike); medians over rounds:
- ``none``: training steps only;
- ``snapshot``: a snapshot after every step into the memory tier (a real keeper process
  checksums and publishes each one); blocked time = the snapshot call + the wait at the fence;
- ``dcp``: a synchronous ``dcp.save`` after every step (to the local disk);
- ``persist``: a snapshot after every step, the block's first one a checkpoint step that the keeper
  writes to disk as a universal checkpoint from the slot (``resihp.ckpt.persist``); blocked time per
  checkpoint = every snapshot call and fence wait of the block, including the wait for the keeper
  to release the slot it reads (``held``).

``stall_ratio`` = blocked time of one snapshot / of one synchronous save; ``overhead_ratio`` =
extra wall time per step with snapshots / with synchronous saves; ``restore_memory_ratio`` =
restore from the rank's own slot (``restore``: all-gather, load; the checksums checked by the
keeper beforehand, as while a job relaunches; ``restore_memory_selfcheck_ratio``: the rank checks
them itself) / a cold-cache ``dcp.load`` (pages dropped with ``posix_fadvise(DONTNEED)`` after
``fsync``; ``cold_resident_bytes``: what fincore still finds cached);
``persist_stall_ratio`` = blocked time per keeper-written checkpoint / per synchronous save;
``persist_overhead_ratio`` = extra wall time per keeper-written checkpoint (its block's steps
against as many plain ones) / extra wall time per synchronous save;
``restore_peer_ratio`` = a rank with no slot restored from a data-parallel peer's over gloo
(two processes, loopback) / the same cold load; ``lost_steps_sigkill`` = the most steps lost
over SIGKILLs at random moments of a training process with that state (its last finished step
against the newest published slot), and ``e2e`` a ``resihp run --recovery restart`` with a
SIGKILLed rank (its ``recovery`` object); ``memory_overhead`` = (extra anonymous RSS + the tier's
bytes in /dev/shm) / bytes of state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from resihp.ckpt.integrity import problem
from resihp.ckpt.keeper import ensure_keeper, request_verify, stop_keeper
from resihp.ckpt.memory import MemoryTier, tier_dir
from resihp.ckpt.persist import LOG, PersistRequest, blocks_of
from resihp.ckpt.snapshot import Snapshotter, restore, state_tensors

WIDTH = 2048


def build(layers: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, batch: int) -> None:
    x = torch.randn(batch, WIDTH)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def state_bytes(model, opt) -> int:
    return sum(t.numel() * t.element_size() for _, t in state_tensors(model, opt))


def flat_state(model, opt) -> dict[str, torch.Tensor]:
    return dict(state_tensors(model, opt))


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_cache(directory: Path) -> None:
    """Evict a checkpoint's pages from the page cache (fsync, then DONTNEED), for a cold load."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dcp_save(model, opt, directory: Path) -> float:
    shutil.rmtree(directory, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(flat_state(model, opt), checkpoint_id=str(directory), no_dist=True)
    return time.perf_counter() - t0


def dcp_cold_load(model, opt, directory: Path) -> float:
    drop_cache(directory)
    t0 = time.perf_counter()
    dcp.load(flat_state(model, opt), checkpoint_id=str(directory), no_dist=True)
    return time.perf_counter() - t0


def keeper_check(directory: Path, timeout_s: float = 120) -> None:
    """Ask the keeper to check every slot and wait for its verdicts."""
    request_verify(directory)
    deadline = time.monotonic() + timeout_s
    while (directory / "VERIFY").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the keeper did not check the slots")
        time.sleep(0.005)


def resident_bytes(directory: Path) -> int | None:
    """Bytes of a folder's files in the page cache right after dropping them (fincore), or None."""
    drop_cache(directory)
    files = [str(p) for p in directory.rglob("*") if p.is_file()]
    try:
        out = subprocess.run(
            ["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(x) for x in out.split() if x.isdigit())


def _wait_published(tier: MemoryTier, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(h.rank == tier.rank and h.step == step for h in tier.headers()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step} never published")
        time.sleep(0.005)


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _init_group(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _peer_restore(rank: int, layers: int, root: str, port: int, repeats: int, out: str) -> None:
    """Rank 0 holds a published slot (its own tier); rank 1 (another tier: another node) has none
    and restores from it over gloo. Rank 1 writes its restore times."""
    torch.set_num_threads(1)
    os.environ["RESIHP_SHM"] = root
    _init_group(rank, 2, port)
    model, opt = build(layers, seed=rank)
    train_step(model, opt, 4)
    tier = MemoryTier(tier_dir("peer", rank), rank)
    if rank == 0:
        ensure_keeper(tier.dir, os.getpid())
        snap = Snapshotter(tier, every=1)
        snap.snapshot(0, model, opt, {"job": "peer"})
        snap.close()
        _wait_published(tier, 0)
        keeper_check(tier.dir)  # as after a failure: the holder offers only a slot that verifies
    times, phases = [], []
    for _ in range(repeats):
        dist.barrier()
        restored = restore(tier, model, opt, {"job": "peer"}, lambda r: [0, 1])
        assert restored is not None and restored.sources == ["memory", "peer"], restored
        times.append(restored.restore_s)
        phases.append(restored.phases_s)
    if rank == 1:
        Path(out).write_text(json.dumps({"times": times, "phases": phases}))
    dist.barrier()
    if rank == 0:
        stop_keeper(tier.dir)
    dist.destroy_process_group()


def _kill_child(layers: int, root: str, steps: int) -> None:
    """A training process with snapshots every step; prints each finished step."""
    torch.set_num_threads(1)
    os.environ["RESIHP_SHM"] = root
    model, opt = build(layers)
    tier = MemoryTier(tier_dir("kill", 0), 0)
    snap = Snapshotter(tier, every=1)
    snap.attach(opt)
    for step in range(steps):
        train_step(model, opt, 8)
        print(step, flush=True)
        snap.snapshot(step, model, opt, {})
    snap.close()


def lost_steps_sigkill(layers: int, kills: int, rng: random.Random) -> list[int]:
    lost = []
    for _ in range(kills):
        with tempfile.TemporaryDirectory(
            dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        ) as root:
            directory = Path(root) / "resihp-kill-n0"
            ensure_keeper(directory, os.getpid())
            code = (
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import "
                f"checkpoint; checkpoint._kill_child({layers}, {root!r}, 1000)"
            )
            child = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            target = rng.randint(2, 5)
            done = -1
            while done < target:
                done = int(child.stdout.readline())
            time.sleep(rng.uniform(0, 0.5))  # a random moment of a later step or copy
            child.send_signal(signal.SIGKILL)
            rest = child.stdout.read().split()
            child.wait()
            done = int(rest[-1]) if rest else done  # the last step whose optimizer step finished
            time.sleep(1.0)  # the keeper publishes what was complete
            tier = MemoryTier(directory, 0)
            good = [h.step for h in tier.headers() if h.rank == 0 and tier.verify(h)]
            lost.append(done - (max(good) if good else -1))
            stop_keeper(directory)
    return lost


def e2e_sigkill(seed: int) -> dict:
    """``resihp run --dp 2 --pp 2 --recovery restart`` with a rank SIGKILLed at a random step."""
    rng = random.Random(seed)
    step = rng.randint(2, 6)
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "resihp.cli",
            "run",
            "-o",
            out,
            "--dp",
            "2",
            "--pp",
            "2",
            "--steps",
            "9",
            "--global-tokens",
            "2048",
            "--budget",
            "512",
            "--max-len",
            "512",
            "--no-live",
            "--json",
            "--recovery",
            "restart",
            "--inject",
            f"stop:rank={rng.randint(0, 3)},step={step}",
        ]
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1:]}
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        return {"inject": cmd[-1], **summary["recovery"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a few minutes)")
    parser.add_argument(
        "--layers", type=int, default=6, help="Linear(2048, 2048) layers (6: 288 MiB of state)"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (6 if args.quick else 12)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    shm = Path(
        tempfile.mkdtemp(
            prefix="resihp-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    os.environ["RESIHP_SHM"] = str(shm)
    disk = Path(tempfile.mkdtemp(prefix="resihp-bench-dcp-", dir=os.environ.get("BENCH_DISK")))
    model, opt = build(args.layers)
    for _ in range(4):  # as many steps as the snapshot phase below trains: the same temporaries
        train_step(model, opt, args.batch)
    nbytes = state_bytes(model, opt)
    rss0 = rss_anon()
    tier = MemoryTier(tier_dir("bench", 0), 0)
    ensure_keeper(tier.dir, os.getpid(), warm=True)
    snap = Snapshotter(tier, every=1)
    persist_root = disk / "persist" / "ckpt"

    def request(due: bool):
        return lambda tensors: PersistRequest(
            str(persist_root),
            1,
            1,
            True,
            blocks_of(model, opt, tensors, None, None, 0),
            {"job_id": "bench", "model_hash": "bench"},
            due,
        ).to_dict()

    snap.attach(opt)
    for i in range(3):  # memory overhead: both slots in use, nothing else of the benchmark yet
        train_step(model, opt, args.batch)
        snap.snapshot(i, model, opt, {"job": "bench"})
    snap.fence()
    shm_bytes = sum(p.stat().st_size for p in tier.dir.glob("*.bin"))
    memory_overhead = (max(0, rss_anon() - rss0) + shm_bytes) / nbytes
    step_s = {"none": [], "snapshot": [], "dcp": [], "persist": []}
    blocked = {"snapshot": [], "dcp": [], "persist": []}
    held = []
    step = 3
    arms = ["none", "snapshot", "dcp", "persist"]
    written = 0
    for r in range(rounds + 1):  # round 0 warms up (first touches of the slots' pages, imports)
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for arm in order:
            n0 = len(snap.blocked_s)
            for i in range(args.steps):
                t0 = time.perf_counter()
                train_step(
                    model, opt, args.batch
                )  # its optimizer step waits for the copy in flight
                if arm in ("snapshot", "persist"):
                    snap.snapshot(
                        step,
                        model,
                        opt,
                        {"job": "bench"},
                        request(i == 0) if arm == "persist" else None,
                    )
                    last = step
                    if i == args.steps - 1:
                        snap.fence()  # the block's last copy is charged to this arm
                elif arm == "dcp":
                    save = dcp_save(model, opt, disk / "ckpt")
                    if r:
                        blocked["dcp"].append(save)
                step += 1
                if r:
                    step_s[arm].append(time.perf_counter() - t0)
            if r and arm == "snapshot":
                blocked["snapshot"] += snap.blocked_s[n0:]
            elif r and arm == "persist":
                blocked["persist"].append(sum(snap.blocked_s[n0:]))
                held.append(sum(snap.held_s[n0:]))
            if arm == "persist":  # the checkpoint on disk before the next arm (untimed)
                written += 1
                deadline = time.monotonic() + 300
                while _lines(persist_root / LOG) < written:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the keeper did not write its checkpoint")
                    time.sleep(0.005)
    snap.close()
    _wait_published(tier, last)
    persisted = [json.loads(line) for line in (persist_root / LOG).read_text().splitlines()][1:]
    kept = sorted(persist_root.glob("step*"))
    persist_ok = len(kept) == 1 and problem(kept[0]) is None  # keep=1: the newest, whole

    # restore: own memory (one-rank group) vs cold dcp.load
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    newest = max(h.step for h in tier.headers() if h.slot in ("A", "B"))
    restore_mem, restore_self, cold = [], [], []
    arms = ["memory", "self", "disk"]
    for i in range(rounds):
        for arm in arms[i % 3 :] + arms[: i % 3]:
            if arm == "disk":
                cold.append(dcp_cold_load(model, opt, disk / "ckpt"))
                continue
            # memory: as after a failure, the keeper has checked the slots while the job relaunched;
            # self: no such check, the restoring rank computes the checksums itself
            (tier.dir / "verified.json").unlink(missing_ok=True)
            if arm == "memory":
                keeper_check(tier.dir)
            restored = restore(tier, model, opt, {"job": "bench"}, lambda r: [0])
            assert restored is not None and restored.step == newest
            (restore_mem if arm == "memory" else restore_self).append(restored.restore_s)
    resident = resident_bytes(disk / "ckpt")
    dist.destroy_process_group()
    stop_keeper(tier.dir)

    # restore from a peer: two processes over gloo
    peer_file = disk / "peer.json"
    port = 29500 + rng.randint(1000, 20000)
    mp.spawn(
        _peer_restore,
        args=(args.layers, str(shm), port, rounds, str(peer_file)),
        nprocs=2,
        join=True,
    )
    peer = json.loads(peer_file.read_text())
    restore_peer = peer["times"]
    peer_phases = {k: statistics.median(p[k] for p in peer["phases"]) for k in peer["phases"][0]}

    lost = lost_steps_sigkill(args.layers, 2 if args.quick else 5, rng)
    e2e = e2e_sigkill(args.seed)
    shutil.rmtree(disk, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)

    med = statistics.median
    extra_snap = med(step_s["snapshot"]) - med(step_s["none"])
    extra_dcp = med(step_s["dcp"]) - med(step_s["none"])
    result = {
        "state_bytes_per_rank": nbytes,
        "state_mib_per_rank": round(nbytes / 2**20, 1),
        "rounds": rounds,
        "steps_per_arm_per_round": args.steps,
        "stall_ratio": round(med(blocked["snapshot"]) / med(blocked["dcp"]), 4),
        "overhead_ratio": round(extra_snap / extra_dcp, 4),
        "persist_stall_ratio": round(med(blocked["persist"]) / med(blocked["dcp"]), 4),
        "persist_overhead_ratio": round(
            (med(step_s["persist"]) - med(step_s["none"])) * args.steps / extra_dcp, 4
        ),
        "persist_checkpoints_verify": persist_ok,
        "restore_memory_ratio": round(med(restore_mem) / med(cold), 4),
        "restore_peer_ratio": round(med(restore_peer) / med(cold), 4),
        "restore_memory_selfcheck_ratio": round(med(restore_self) / med(cold), 4),
        "cold_resident_bytes": resident,
        "lost_steps_sigkill": max(lost),
        "lost_steps_sigkill_each": lost,
        "memory_overhead": round(memory_overhead, 3),
        "seconds": {
            "snapshot_blocked": med(blocked["snapshot"]),
            "dcp_save_blocked": med(blocked["dcp"]),
            "snapshot_copy": med(snap.copy_s[1:] or snap.copy_s),
            "step_none": med(step_s["none"]),
            "step_snapshot": med(step_s["snapshot"]),
            "step_dcp": med(step_s["dcp"]),
            "step_persist": med(step_s["persist"]),
            "persist_blocked_per_checkpoint": med(blocked["persist"]),
            "persist_held_per_checkpoint": med(held),
            "persist_keeper_hold": med(p["hold_s"] for p in persisted),
            "persist_keeper_total": med(p["total_s"] for p in persisted),
            "restore_memory": med(restore_mem),
            "restore_memory_selfcheck": med(restore_self),
            "restore_peer": med(restore_peer),
            "restore_peer_phases": peer_phases,
            "dcp_load_cold": med(cold),
        },
        "fence_waits": snap.fence_waits,
        "e2e": e2e,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "torch": torch.__version__,
            "disk": str(disk.parent),
        },
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
