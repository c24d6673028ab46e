"""Engine replicas in their own processes: one call's prompts split over them, in order;
a replica that fails to start or dies is a clear error and leaves no process behind."""


import psutil
import pytest

from peagle.config import VllmConfig
from peagle.serving import EngineStartError
from peagle.serving.engine import engine_kwargs
from peagle.serving.generation import generate_from_token_ids
from peagle.serving.pool import EnginePool, ReplicaLostError, engine_max_model_len, even_chunks, open_engines
from tests.cores import needs_cores

CFG = VllmConfig(max_model_len=256, max_num_seqs=8, cpu_kvcache_space_gib=1)
DP2 = CFG.model_copy(update={"data_parallel_size": 2})
PROMPTS = [[1, 3] + list(range(20 + i, 40 + i)) for i in range(7)]

needs_two_cores = needs_cores(2)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from peagle.testing.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


@pytest.mark.parametrize("n,parts", [(0, 2), (1, 2), (7, 2), (8, 3), (3, 5)])
def test_even_chunks_cover_the_prompts_in_order(n, parts):
    bounds = even_chunks(n, parts)
    assert len(bounds) == parts
    assert [i for a, b in bounds for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_one_engine_whatever_the_replica_count():
    """Evaluation and serving measure one engine; replicas are the pool's business."""
    kwargs = engine_kwargs("m", DP2)
    assert kwargs["tensor_parallel_size"] == 1 and "data_parallel_size" not in kwargs


def descendants() -> set[int]:
    """Running processes under this one, but for multiprocessing's long-lived resource tracker."""
    running = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                running.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return set(running)


@needs_two_cores
@pytest.mark.slow
def test_a_replica_that_cannot_start_is_an_engine_start_error(tmp_path):
    before = descendants()
    with pytest.raises(EngineStartError, match=r"engine replica \d: .*could not start an engine"):
        with open_engines(str(tmp_path / "no-such-model"), DP2):
            pass
    assert descendants() - before == set()  # every replica (and its engine) is gone


@pytest.mark.slow
@needs_two_cores
def test_replicas_answer_in_prompt_order_and_a_dead_one_is_reported(tiny_model):
    with open_engines(tiny_model, CFG, dtype="float32") as llm:
        one = generate_from_token_ids(llm, PROMPTS, max_tokens=[4 + i for i in range(len(PROMPTS))])
    before = descendants()
    with open_engines(tiny_model, DP2, dtype="float32") as pool:
        assert isinstance(pool, EnginePool) and pool.size == 2 and engine_max_model_len(pool) == 256
        two = generate_from_token_ids(pool, PROMPTS, max_tokens=[4 + i for i in range(len(PROMPTS))])
        assert [c.token_ids for c in two] == [c.token_ids for c in one]  # greedy, prompt order, per-prompt budgets
        assert [len(c.token_ids) for c in two] == [4 + i for i in range(len(PROMPTS))]

        psutil.Process(pool._procs[1].pid).kill()
        with pytest.raises(ReplicaLostError, match=r"engine replica 1 of 2 \(pid \d+\) exited with code -9"):
            generate_from_token_ids(pool, PROMPTS, max_tokens=[4] * len(PROMPTS))
        assert not any(p.is_alive() for p in pool._procs)  # the survivor was stopped too
    assert descendants() - before == set()  # no engine process left behind
