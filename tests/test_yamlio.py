import pytest

from resihp.errors import InputError
from resihp.yamlio import read_yaml_mapping


def test_reads_a_mapping(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("dp_size: 2\nname: x\n")
    assert read_yaml_mapping(path, "job meta", "must be a mapping") == {"dp_size": 2, "name": "x"}


def test_missing_file_names_file_and_what(tmp_path):
    with pytest.raises(InputError, match=r"nope\.yaml: cannot read job meta \("):
        read_yaml_mapping(tmp_path / "nope.yaml", "job meta", "must be a mapping")


def test_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(InputError, match=r"bad\.yaml:\d+: not valid YAML \(.+\)$"):
        read_yaml_mapping(path, "cluster", "must be a mapping")


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just text\n", ""])
def test_non_mapping_gives_the_expected_message(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=r"list\.yaml: expected a YAML mapping describing the model$"):
        read_yaml_mapping(path, "model", "expected a YAML mapping describing the model")
