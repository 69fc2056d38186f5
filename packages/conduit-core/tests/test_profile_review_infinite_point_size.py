"""Review of the profile file's reading: a link point at an infinite transfer size.

``LinkCost`` refused points of no positive size or bandwidth, but took one at an infinite size, which a profile
file's ``Infinity`` (read by ``json``) gives: a point no transfer measured. A link of that one point priced every
transfer at its figure, and ``load_profile`` read such a file as a measurement. It is now refused, and the file is
a ``PlacementError`` to re-create.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost
from conduit.placement.profile import load_profile, machine_id


def test_a_point_at_an_infinite_size_is_refused() -> None:
    with pytest.raises(PlacementError, match="points"):
        LinkCost(1e-6, ((math.inf, 5e9),))
    with pytest.raises(PlacementError, match="points"):
        LinkCost(1e-6, ((4096.0, 1e9), (math.inf, 5e9)))
    assert LinkCost(1e-6, ((4096.0, math.inf),)).seconds(4096) == 1e-6  # an unlimited bandwidth is still one


def test_a_profile_file_with_a_point_at_an_infinite_size_is_not_read(tmp_path: Path) -> None:
    good = BandwidthProfile({"host_copy": LinkCost(2e-6, ((65536.0, 1e10),))}, source="measured",
                            machine=machine_id(), created="2000-01-01T00:00:00+00:00", details={})
    path = good.save(tmp_path / "profile.json")
    assert load_profile(path).links["host_copy"].points == ((65536.0, 1e10),)
    data = json.loads(path.read_text())
    data["links"]["host_copy"]["points"] = [[math.inf, 1e10]]  # written as Infinity
    path.write_text(json.dumps(data))
    assert "Infinity" in path.read_text()
    with pytest.raises(PlacementError, match="points"):
        load_profile(path)  # was: read, every host copy priced at 10 GB/s
