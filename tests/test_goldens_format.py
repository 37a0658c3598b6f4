import json

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conformance.core.goldens import GoldenError, dumps, load, normalise


def test_normalise_plain_types():
    data = {
        "spec": P("fsdp", ("data", "tensor"), None),
        "dtype": np.dtype("float32"),
        "n": np.int64(3),
        "x": float("nan"),
        "shape": (2, 3),
    }
    assert normalise(data) == {
        "spec": ["fsdp", ["data", "tensor"], None],
        "dtype": "float32",
        "n": 3,
        "x": "nan",
        "shape": [2, 3],
    }


def test_dumps_one_leaf_per_line_sorted():
    text = dumps({"leaves": {"b": {"shape": [2]}, "a": {"shape": [1]}}, "count": 2})
    assert text.splitlines() == [
        "{",
        '  "count": 2,',
        '  "leaves": {',
        '    "a": {"shape": [1]},',
        '    "b": {"shape": [2]}',
        "  }",
        "}",
    ]
    assert json.loads(text)["leaves"]["a"] == {"shape": [1]}


def test_load_names_missing_and_corrupted_files(tmp_path):
    with pytest.raises(GoldenError, match=r"missing golden .*nope\.json"):
        load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"leaves": {', encoding="utf-8")
    with pytest.raises(GoldenError, match=r"corrupted golden .*bad\.json"):
        load(bad)
