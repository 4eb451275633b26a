"""The kernel tests (test_kernels.py) skip where specdec's kernels cannot be built, so a source
that stopped compiling would skip them as well, and int4 would quietly fall back to torch's
kernel. Where a C++ compiler and ninja are present, the build must succeed."""
import shutil

import pytest

from specdec.models import kernels


def test_the_kernels_build_wherever_a_compiler_and_ninja_are_present():
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("no ninja")
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    assert kernels.load(), kernels.unavailable_reason()
