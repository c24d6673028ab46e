"""How many engine replicas the data stage starts: ``vllm.data_parallel_size``, whose default,
``auto``, keeps every visible GPU busy and starts one engine on CPU."""

import pytest

from peagle.config import ConfigError, VllmConfig, load_config
from peagle.serving.engine import data_parallel_replicas, replica_environments, replicas_for


@pytest.mark.parametrize("devices, tp, replicas", [(8, 1, 8), (8, 2, 4), (8, 3, 2), (3, 2, 1), (1, 1, 1)])
def test_auto_fills_the_visible_gpus_with_engines_of_tensor_parallel_size(devices, tp, replicas):
    assert replicas_for(devices, tp) == replicas


def test_auto_is_one_engine_on_the_cpu_build_and_a_number_is_taken_as_written():
    assert VllmConfig().data_parallel_size == "auto"
    assert data_parallel_replicas(VllmConfig()) == 1  # every core already computes for it
    assert len(replica_environments(VllmConfig())) == 1
    assert data_parallel_replicas(VllmConfig(data_parallel_size=2)) == 2


@pytest.mark.parametrize("value", ["0", "many", "1.5"])
def test_a_count_that_is_no_count_is_refused(tmp_path, value):
    path = tmp_path / "config.yaml"
    path.write_text(f"name: x\nvllm:\n  data_parallel_size: {value}\n")
    with pytest.raises(ConfigError, match="vllm.data_parallel_size"):
        load_config(path)


@pytest.mark.gpu
def test_auto_on_a_gpu_node_starts_an_engine_per_visible_gpu():
    import torch

    pytest.importorskip("vllm")
    from peagle.serving.engine import is_cpu_platform

    if is_cpu_platform():
        pytest.skip("vLLM here is its CPU build")
    assert data_parallel_replicas(VllmConfig()) == torch.cuda.device_count()
    assert [env["CUDA_VISIBLE_DEVICES"] for env in replica_environments(VllmConfig())] == \
        [str(i) for i in range(torch.cuda.device_count())]
