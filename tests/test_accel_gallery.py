"""The accelerate() gallery page (gallery/accelerate/main.py): the LLaMA gallery model on
variable-length batches through ``accelerate()`` with bucketing, eager and lazy, equal losses and
one lazy program per bucket (+ the first step's)."""

import pytest

from gallery.accelerate import main as page


@pytest.mark.slow
def test_gallery_page_eager_and_lazy_agree_with_one_program_per_bucket():
    eager, lazy = page.main(
        ["--steps", "4", "--warmup", "1", "--buckets", "64,16", "--max-len", "64", "--json"]
    )
    assert (eager["backend"], lazy["backend"]) == ("eager", "lazy")
    for a, b in zip(lazy["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (lazy["losses"], eager["losses"])
    assert 1 <= lazy["programs"] <= 2 + 1, lazy["programs"]
