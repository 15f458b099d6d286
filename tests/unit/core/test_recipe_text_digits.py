"""Recipe text reads layers from ASCII digits only: ``int()`` also accepts Arabic-Indic digits ("٣" is 3), which
``parse_fields`` used to turn into a layer index when called directly (``Recipe.parse`` refused them earlier)."""

from vitcam_nb.core.recipe_text import parse_fields


def test_ascii_digits_are_a_layer_index():
    assert parse_fields("F1@3", {})["layer"] == 3
    assert parse_fields("F1@-1", {})["layer"] == -1


def test_arabic_indic_digits_are_not_a_layer_index():
    layer = parse_fields("F1@\u0663", {})["layer"]
    assert layer == "\u0663" and not isinstance(layer, int)
