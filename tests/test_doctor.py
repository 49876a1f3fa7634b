"""`hybrid doctor` on the CPU: no kernel backend, so every kernel is "n/a" and its reference is
checked against float64 numpy; a reference that is off fails the command in one line.
(tests/test_metal.py runs it with the Metal kernels emulated.)"""

import pytest
from tests.helpers.cli import assert_one_line_error, run

from mlx_hybrid import doctor, kernels


@pytest.fixture(autouse=True)
def cpu(monkeypatch):
    """No kernel backend, whatever this machine has."""
    monkeypatch.setattr(kernels, "kernel_backend", lambda: None)


def test_doctor_on_the_cpu_checks_every_reference(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, "doctor")
    assert code == 0, out
    n = len(doctor.cases())
    assert n == 10  # every kernel of metal_kernels/, beam_topk in its two launches
    assert "backend          none" in out and f"all {n} checks passed" in out
    for case in doctor.cases():
        assert f"{case.kernel} " in out
    assert out.count("n/a") == 2 * n + 1  # the kernel columns, and the simdgroup width


@pytest.mark.parametrize("kernel", ["ssm_step", "dsla_step", "pack_beams"])
def test_a_wrong_reference_fails_the_doctor(monkeypatch, capsys, kernel):
    """A float output 1% off, or an integer output off by one, fails its row and the command."""
    cases = doctor.cases

    def off(seed=0):
        found = cases(seed)
        case = next(c for c in found if c.kernel == kernel)
        expect = case.expect
        case.expect = lambda: [e * 1.01 if e.dtype.kind == "f" else e + 1 for e in expect()]
        return found

    monkeypatch.setattr(doctor, "cases", off)
    code, out, err = run(monkeypatch, capsys, "doctor")
    assert f"{kernel}: reference off by" in out
    assert_one_line_error(code, err, f"1 of {len(cases())} kernel checks failed")
