"""The live loop plans for the machine it runs on: measured memory and device speed."""

from resihp.perf.device import available_memory_gb, measured_tflops
from resihp.train.config import RunConfig
from resihp.train.planning import planner_specs


def test_live_cluster_is_measured_not_invented():
    cfg = RunConfig.from_flags(dp=2, pp=2, device="cpu")
    cluster, model = planner_specs(cfg)
    assert len(cluster.devices) == 4 and model.layers == cfg.model.layers
    device = cluster.devices[0]
    # memory: what the kernel says is available now, shared by the node's 4 ranks
    assert 0 < device.memory_gb <= available_memory_gb() / 4 * 1.5
    assert device.tflops > 0 and device.tflops != 1.0  # a matmul measured on one thread


def test_measured_tflops_restores_the_thread_count():
    import torch

    before = torch.get_num_threads()
    assert measured_tflops("cpu", threads=1, size=64, seconds=0.01) > 0
    assert torch.get_num_threads() == before
