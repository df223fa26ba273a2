"""fp32 CPU linears through oneDNN (parallel/cpu/linear.py) against float64 ``F.linear`` and its
autograd, the oracle: the plain function, the autograd function (input, weight and bias
gradients, frozen weights) and megatron's column/row-parallel layers at TP=1 and TP=2, where the
column layer's input gradient must be all-reduced. (Whole models through it still match HF
transformers: tests/megarl/workers, tests/megarl/rollout/test_engine.py; SGLang's linears through it:
tests/megarl/rollout/test_cpu_linear.py.) These force oneDNN
(``MEGARL_CPU_LINEAR=onednn``), whichever backend this machine would choose; the automatic choice
is tested at the end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from parallel.cpu import linear as cpu_linear
from parallel.spawn import run_on_ranks
from tests.parallel.cpu import rank_fns

ROOT = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("onednn_linears")


def _operands(seed, *x_shape, out_features=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*x_shape, generator=g)
    return x, torch.randn(out_features, x_shape[-1], generator=g) * 0.1, torch.randn(out_features, generator=g)


def test_the_onednn_path_takes_fp32_cpu_operands():
    x, weight, _ = _operands(0, 4, 8)
    assert cpu_linear.backend() == "onednn" and cpu_linear.applies(x, weight)
    assert not cpu_linear.applies(x.double(), weight.double())  # oneDNN has no fp64 matmul


@pytest.mark.parametrize("shape", [(37, 64), (5, 7, 64), (0, 64)], ids=["2d", "3d", "empty"])
def test_linear_equals_float64_linear(shape):
    x, weight, bias = _operands(1, *shape)
    want = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(cpu_linear.linear(x, weight, bias).double(), want, rtol=1e-5, atol=1e-5)
    # strided operands (a transposed input and weight, as the backward passes them): no copies
    xt = x.reshape(-1, 64).t().contiguous().t()
    torch.testing.assert_close(cpu_linear.linear(xt, weight.t().contiguous().t()).double(),
                               F.linear(xt.double(), weight.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen_weight"])
def test_linear_function_gradients_equal_float64_autograd(frozen):
    x, weight, bias = _operands(2, 6, 5, 64)
    grad_out = torch.randn(6, 5, 48, generator=torch.Generator().manual_seed(3))

    def run(dtype, fn):
        leaves = [t.to(dtype, copy=True).requires_grad_(not (frozen and i > 0)) for i, t in enumerate((x, weight, bias))]
        out = fn(*leaves)
        out.mul_(1.0)  # an in-place change, as megatron's cross entropy makes: the output is no view
        (out * grad_out.to(dtype)).sum().backward()
        return out.detach().double(), [None if t.grad is None else t.grad.double() for t in leaves]

    got_out, got_grads = run(torch.float32, lambda *a: cpu_linear.LinearFunction.apply(*a))
    want_out, want_grads = run(torch.float64, F.linear)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp,frozen", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2_frozen_column"])
def test_megatron_parallel_linears_take_it_and_equal_the_dense_oracle(tp, frozen):
    x, col_weight, col_bias = _operands(4, 7, 3, 32, out_features=40)
    row_weight = torch.randn(32, 40, generator=torch.Generator().manual_seed(5)) * 0.1
    grad_out = torch.randn(7, 3, 32, generator=torch.Generator().manual_seed(6))
    results = run_on_ranks(rank_fns.megatron_linear_pair, tp, x, col_weight, col_bias, row_weight,
                           grad_out, frozen, timeout_s=180)

    leaves = [t.double().requires_grad_(True) for t in (x, col_weight, col_bias, row_weight)]
    out = F.linear(F.linear(leaves[0], leaves[1], leaves[2]), leaves[3])
    (out * grad_out.double()).sum().backward()
    local = 40 // tp
    for rank, got in enumerate(results):
        mine = slice(rank * local, (rank + 1) * local)
        assert got["nodes"] == ("LinearFunctionBackward", "LinearFunctionBackward")
        close = dict(rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got["output"].double(), out.detach(), **close)
        torch.testing.assert_close(got["x_grad"].double(), leaves[0].grad, **close)  # all-reduced at TP=2
        torch.testing.assert_close(got["row_weight_grad"].double(), leaves[3].grad[:, mine], **close)
        if frozen:
            assert got["col_weight_grad"] is None and got["col_bias_grad"] is None
        else:
            torch.testing.assert_close(got["col_weight_grad"].double(), leaves[1].grad[mine], **close)
            torch.testing.assert_close(got["col_bias_grad"].double(), leaves[2].grad[mine], **close)


def test_auto_times_both_once_per_machine_and_every_process_follows_what_it_wrote(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_linear.ENV_VAR, "auto")
    monkeypatch.setenv(cpu_linear.CACHE_DIR_ENV_VAR, str(tmp_path))
    cpu_linear.backend.cache_clear()
    chosen = cpu_linear.backend()
    path = tmp_path / cpu_linear.CACHE_FILE
    entry = json.loads(path.read_text())[cpu_linear.machine_key()]
    assert chosen == entry["backend"] == min(("onednn", "aten"), key=lambda name: entry[f"{name}_s"])
    # Later readers take the written answer instead of timing again: they follow an edited one,
    # in this process and in a fresh interpreter.
    other = "aten" if chosen == "onednn" else "onednn"
    path.write_text(json.dumps({cpu_linear.machine_key(): dict(entry, backend=other)}))
    cpu_linear.backend.cache_clear()
    assert cpu_linear.backend() == other
    fresh = subprocess.run([sys.executable, "-c", "from parallel.cpu import linear; print(linear.backend())"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fresh.stdout.strip() == other, fresh.stderr[-2000:]


def test_a_misspelt_choice_is_refused_naming_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_VAR, "mkl")
    cpu_linear.backend.cache_clear()
    with pytest.raises(ValueError, match=r"MEGARL_CPU_LINEAR='mkl' is not one of \('auto', 'onednn', 'aten'\)"):
        cpu_linear.backend()
