"""The equivalence verdict of an interval that straddles a margin edge is "inconclusive", never "not
equivalent": only an interval wholly beyond the margin says the difference exceeds it."""

from __future__ import annotations

import pytest

from hif8qat.stats.paired import EQUIVALENT, INCONCLUSIVE, NOT_EQUIVALENT, equivalence_verdict

MARGIN = 1.0


@pytest.mark.parametrize("lo,hi", [(-1.5, -0.5), (0.5, 1.5), (-1.5, 1.5), (-1.0, 0.5), (-0.5, 1.0), (1.0, 2.0),
                                   (-2.0, -1.0)],
                         ids=["lower-edge", "upper-edge", "both-edges", "on-lower-edge", "on-upper-edge",
                              "from-upper-edge", "to-lower-edge"])
def test_an_interval_on_or_across_a_margin_edge_is_inconclusive(lo, hi):
    assert equivalence_verdict(lo, hi, MARGIN) == INCONCLUSIVE


@pytest.mark.parametrize("lo,hi,verdict", [(-0.99, 0.99, EQUIVALENT.format(m="1")), (1.01, 2.0, NOT_EQUIVALENT),
                                           (-2.0, -1.01, NOT_EQUIVALENT)])
def test_inside_and_wholly_beyond_the_margin(lo, hi, verdict):
    assert equivalence_verdict(lo, hi, MARGIN) == verdict
