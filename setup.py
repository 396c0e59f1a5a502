"""Builds tracecmp's only native part, the statistics kernel ``tracecmp._cstats``.

Everything else is in pyproject.toml. The extension is optional: when no C++ compiler is
available the install still succeeds (with a warning) and tracecmp computes statistics with its
pure-torch reference. The module includes no torch headers, so it needs no torch at build time
and survives torch upgrades (see csrc/README.md).
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
            f"WARNING: building tracecmp._cstats failed ({exc}); tracecmp will use its slower "
            "pure-torch statistics.",
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
            extra_link_args=["-pthread"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
