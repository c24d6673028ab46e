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


def test_vllm_devices_names_the_gpus_the_engines_use(monkeypatch):
    """On a GPU node, vllm.devices narrows the engines to its GPUs (as CUDA_VISIBLE_DEVICES would)."""
    from peagle.serving import engine

    monkeypatch.setattr(engine, "is_cpu_platform", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert [env["CUDA_VISIBLE_DEVICES"] for env in replica_environments(VllmConfig())] == [str(i) for i in range(8)]
    narrowed = VllmConfig(devices=["6", "7"])
    assert data_parallel_replicas(narrowed) == 2
    assert [env["CUDA_VISIBLE_DEVICES"] for env in replica_environments(narrowed)] == ["6", "7"]
    with pytest.raises(Exception, match="vllm.devices, else CUDA_VISIBLE_DEVICES"):
        replica_environments(VllmConfig(devices=["7"], data_parallel_size=2))


# a train section whose two ranks run on GPUs 0 and 1
TWO_RANKS_ON_0_1 = {"recipe": {"batch_size": 2}, "launch": {"devices": ["0", "1"], "world_size": 2}}


def test_streamed_engines_and_ranks_on_the_same_gpus_are_refused_with_the_fix():
    from peagle.config import parse_config
    from peagle.train.launch import devices_shared

    base = {"name": "d", "target": {"model": "embedded"},
            "data": {"sources": [{"kind": "jsonl", "path": "p.jsonl"}], "hidden_states": "streamed"}}
    with pytest.raises(ValueError, match="GPU\\(s\\) 1 are in both vllm.devices and train.launch.devices"):
        parse_config({**base, "vllm": {"devices": ["1", "2"]}, "train": TWO_RANKS_ON_0_1})
    with pytest.raises(ValueError, match="holds fewer GPUs than the 2 rank"):
        parse_config({**base, "train": {**TWO_RANKS_ON_0_1, "launch": {"devices": ["0"], "world_size": 2}}})
    apart = parse_config({**base, "vllm": {"devices": ["7"]}, "train": TWO_RANKS_ON_0_1})
    assert apart.section_hash("vllm") == parse_config(base).section_hash("vllm")  # where, not what
    assert devices_shared(["6", "7"], ["0", "1"]) is None
    message = devices_shared([str(i) for i in range(8)], ["0", "1"])
    assert "GPU(s) 0, 1 would serve both vLLM" in message and "set vllm.devices and train.launch.devices" in message


def test_a_separate_producer_is_for_a_streamed_split_and_its_hosts_gpus_are_its_own():
    """data.producer: separate extracts on another host: the training node's vllm.devices may name
    the ranks' GPUs (its engines run elsewhere), it is no part of the head's identity, and a stored
    split has nothing to produce."""
    from peagle.config import parse_config

    base = {"name": "d", "target": {"model": "embedded"},
            "data": {"sources": [{"kind": "jsonl", "path": "p.jsonl"}], "hidden_states": "streamed"}}
    separate = parse_config({**base, "data": {**base["data"], "producer": "separate"},
                             "vllm": {"devices": ["0", "1"]}, "train": TWO_RANKS_ON_0_1})
    assert separate.section_hash("data", "train") == parse_config(
        {**base, "train": TWO_RANKS_ON_0_1}).section_hash("data", "train")
    with pytest.raises(ValueError, match="data.producer: separate extracts a streamed train split"):
        parse_config({**base, "data": {**base["data"], "hidden_states": "stored", "producer": "separate"}})
