"""Laneformer through the monokernel on a real GPU (`-m gpu`, KIE_GPU_TESTS=1): parity with dense/reference.py's
decoder in fp32 on the same (arena) weights, the kernel's KV cache and prefill in fp32 too (test_monokernel_gpu.py's
assert_parity: teacher-forced argmax up to near ties, 8+ free-running greedy steps equal, LM tile maxima).
The tiny configs of test_laneformer.py in bf16, and laneformer-2b at full width (4 of its 15 layers: delay 2, so
layers 2-3 read the ring; the first 4 layers are windowed) in fp16 (the preview's dtype) and bf16."""
import pytest
import torch

from kie_moe.dense.reference import LaneformerDecoder
from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import ArenaStore, MonokernelBackend
from kie_moe.sampling import SamplingParams

from .test_laneformer import CASES, PROMPT, lane_model  # noqa: F401  (lane_model: the fixture)
from .test_monokernel_gpu import assert_parity

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_laneformers_match_reference(case, lane_model):  # noqa: F811
    m = lane_model(CASES[case][0])
    be = MonokernelBackend(m, CUDA, kv_dtype=torch.float32)          # bf16 arena
    ref = LaneformerDecoder(m.spec, ArenaStore(be.plan), CUDA, torch.float32)
    be._prefill_decoder = ref
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert len(got) == 16
    assert_parity(be, ref, PROMPT, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_laneformer_2b_width_parity(dtype):
    spec = P.preset_spec("laneformer-2b", 4)
    plan = P.build_plan(spec, None, CUDA, random_seed=1, wdtype=dtype)
    assert plan.dims.LANES == 8 and plan.weights.dtype == dtype
    ref = LaneformerDecoder(spec, ArenaStore(plan), CUDA, torch.float32)
    be = MonokernelBackend(None, CUDA, plan=plan, kv_dtype=torch.float32)
    be._prefill_decoder = ref
    prompt = [(37 * i + 11) % spec.vocab_size for i in range(24)]
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert len(got) == 16
    assert_parity(be, ref, prompt, got)
    be.n_splits_override = 4                     # attention split over the sequence
    assert_parity(be, ref, prompt, list(be.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True),
                                                    set())))
