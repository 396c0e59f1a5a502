"""Builds tracecmp's two native modules: ``tracecmp._cstats`` and ``tracecmp._crecord``.

``_cstats`` is the fused statistics kernel; ``_crecord`` is the capture mode's per-op path. Everything
else is in pyproject.toml. Both are optional: when no C++ compiler is available the install still
succeeds (with a warning) and tracecmp runs their pure-Python/torch references. Neither includes
torch headers, so they need no torch at build time and survive torch upgrades (see csrc/README.md).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CXX_FLAGS = [
    "-O3",
    "-std=c++17",
    "-pthread",
    # FMA only where it cannot change a bit; csrc/stats_kernel.hpp blocks it elsewhere.
    "-ffp-contract=fast",
    "-fvisibility=hidden",
    # Vectors live in always-inline code, so the vector-argument ABI note does not apply.
    "-Wno-psabi",
]


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing, so installs work without a compiler."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure means "no extension"
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        print(
            f"WARNING: building a tracecmp extension failed ({exc}); tracecmp will use its slower "
            "pure-Python/torch reference for it.",
            file=sys.stderr,
        )


setup(
    ext_modules=[
        Extension(
            "tracecmp._cstats",
            sources=["csrc/cstats.cpp"],
            depends=["csrc/stats_kernel.hpp", "csrc/stats_x86.hpp"],
            language="c++",
            extra_compile_args=CXX_FLAGS,
            extra_link_args=["-pthread"] + (["-ldl"] if sys.platform.startswith("linux") else []),
        ),
        Extension(
            "tracecmp._crecord",
            # One module, its files by concern: the module, the row buffers, tensor identity, sampled
            # self-checks, the per-op path.
            sources=[
                "csrc/record.cpp",
                "csrc/record_buffer.cpp",
                "csrc/record_identity.cpp",
                "csrc/record_check.cpp",
                "csrc/record_dispatch.cpp",
            ],
            depends=["csrc/record.hpp"],
            language="c++",
            extra_compile_args=CXX_FLAGS,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
