"""The exported format in the installed vLLM: a known-answer head must be accepted in full.

The golden head (peagle.testing.golden) drafts the marker target's constant token only
if vLLM loads fc, every layer, norm, lm_head, the d2t offsets and mask_hidden under the
names we write; any misnamed or misread tensor lowers the acceptance length below K + 1.
"""

import pytest

from peagle.config import VllmConfig
from peagle.export.validate import validate_head

pytestmark = pytest.mark.slow
K = 3


def test_golden_head_loads_and_every_draft_is_accepted(golden_pair):
    target, head = golden_pair  # tests/conftest.py: built once for the whole run
    cfg = VllmConfig(max_model_len=256, max_num_seqs=4, cpu_kvcache_space_gib=1)
    report = validate_head(head, target, vllm_cfg=cfg, num_speculative_tokens=K, min_acceptance_length=K + 1 - 1e-6)
    check = report.vllm
    assert report.checks[-1] == "served in vLLM"
    assert check.num_drafts > 0
    assert check.num_draft_tokens == K * check.num_drafts  # parallel drafting: K tokens per draft
    assert check.acceptance_length == pytest.approx(K + 1)
    assert check.per_position_acceptance == pytest.approx([1.0] * K)
    assert check.engine_start_s > 0
