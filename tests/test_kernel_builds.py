"""``benchmarks.kernel_builds``: two builds of the kernel side by side, each result checked."""

from __future__ import annotations

import pytest

from ascend_graph import kernels
from benchmarks import kernel_builds

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="needs the kernel (a C compiler and AVX512-BF16 or AVX2 and FMA)")


def test_two_builds_are_timed_side_by_side_and_a_wrong_one_is_refused(tmp_path):
    with open(kernels.SOURCE) as f:
        source = f.read()
    dlls = {"old": kernel_builds.build(source, str(tmp_path), "old"),
            "now": kernel_builds.build(source, str(tmp_path), "now")}
    rows = kernel_builds.rows_rates(dlls, rows=(1, 5, 17), n=70, k=96, runs=1)
    assert [r["rows"] for r in rows] == [1, 5, 17]
    assert all(r["old"] > 0 and r["now"] > 0 for r in rows)
    assert set(kernel_builds.paged_times(dlls, seqs=2, context=64, runs=1)) == {"old", "now"}
    assert set(kernel_builds.paged_times(dlls, seqs=2, context=64, width=40, runs=1, values=True)) == {"old", "now"}
    # every rounding to bf16 (one at a time; AVX2's 4 and 8 at a time) doubling its input
    doubled = source
    for head, double in [("to_bf16(float f) {", "f = 2 * f;"), ("to_bf16_4(__m128 v) {", "v = _mm_add_ps(v, v);"),
                         ("to_bf16_8(__m256 v) {", "v = _mm256_add_ps(v, v);")]:
        assert head in doubled
        doubled = doubled.replace(head, f"{head}\n    {double}", 1)
    dlls["now"] = kernel_builds.build(doubled, str(tmp_path), "doubled")
    with pytest.raises(ValueError, match="now at 1 rows is not within one rounding"):
        kernel_builds.rows_rates(dlls, rows=(1,), n=70, k=96, runs=1)
    with pytest.raises(ValueError, match="now's paged scores are not within one rounding"):
        kernel_builds.paged_times(dlls, seqs=2, context=64, runs=1)
    # the [K, N] form's sums starting off zero: its values are refused
    offset = source.replace("memset(sums, 0, (size_t)(rows * 32 * blocks) * sizeof(float));",
                            "memset(sums, 0x3f, (size_t)(rows * 32 * blocks) * sizeof(float));", 1)
    assert offset != source
    dlls["now"] = kernel_builds.build(offset, str(tmp_path), "offset")
    kernel_builds.paged_times(dlls, seqs=2, context=64, runs=1)  # the scores do not use those sums
    with pytest.raises(ValueError, match="now's paged values are not within one rounding"):
        kernel_builds.paged_times(dlls, seqs=2, context=64, width=40, runs=1, values=True)
