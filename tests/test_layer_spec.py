import pytest

from fcsd.connectivity.layer_spec import format_layers, parse_layer_spec


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", list(range(10))),
        ("none", []),
        (None, []),
        ("last:3", [7, 8, 9]),
        ("first:2", [0, 1]),
        ("last:50%", [5, 6, 7, 8, 9]),
        ("first:25%", [0, 1, 2]),  # 2.5 rounds half up
        ("last:100%", list(range(10))),
        ("0,3,5-7", [0, 3, 5, 6, 7]),
        (" 1 , 2 ", [1, 2]),
        ("[4, 2]", [2, 4]),
        ([9, 0, 0], [0, 9]),
        (4, [4]),
    ],
)
def test_specs_resolve(spec, expected):
    assert parse_layer_spec(spec, 10) == expected


@pytest.mark.parametrize("spec", ["last-2", "middle:3", "3-1", "first:1.5", "a,b", True, ["1"], "last:150%"])
def test_bad_specs_show_the_grammar(spec):
    with pytest.raises(ValueError, match="grammar"):
        parse_layer_spec(spec, 10)


@pytest.mark.parametrize("spec", ["12", "0,10", [11], "last:11"])
def test_out_of_range_names_the_layer_count(spec):
    with pytest.raises(ValueError, match="10"):
        parse_layer_spec(spec, 10)


def test_format_round_trips():
    for indices in ([0, 1, 2, 5], [3], [], [0, 2, 4, 5, 6, 9]):
        assert parse_layer_spec(format_layers(indices), 10) == indices
    assert format_layers([0, 1, 2, 5]) == "0-2,5"
