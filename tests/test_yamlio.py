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
    with pytest.raises(
        InputError, match=r"list\.yaml: expected a YAML mapping describing the model$"
    ):
        read_yaml_mapping(path, "model", "expected a YAML mapping describing the model")


# --- issue 20: aliases, unknown keys, size -------------------------------------------------------
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi")
)


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)  # ~600 bytes; 9^9 strings if expanded
    t0 = time.perf_counter()
    with pytest.raises(
        InputError,
        match=r"bomb\.yaml:2: not valid YAML \(YAML aliases \(\*name\) are not allowed\)",
    ):
        read_yaml_mapping(path, "cluster", "must be a mapping")
    assert time.perf_counter() - t0 < 1.0


def test_scenario_loader_refuses_aliases_too(tmp_path):
    from resihp.replay.yamlsrc import load_yaml

    path = tmp_path / "s.yaml"
    path.write_text("base: &b {dp: 2}\nparallel: *b\n")
    with pytest.raises(InputError, match=r"s\.yaml:2: not valid YAML \(YAML aliases"):
        load_yaml(path)
    path.write_text("parallel: {dp: 2}\n")
    assert load_yaml(path)["parallel"] == {"dp": 2} and load_yaml(path).line == 1


def test_oversized_file_is_refused(tmp_path, monkeypatch):
    import resihp.yamlio

    monkeypatch.setattr(resihp.yamlio, "MAX_BYTES", 100)
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 200 + "\n")
    with pytest.raises(InputError, match=r"big\.yaml: 204 bytes; a model file is at most"):
        read_yaml_mapping(path, "model", "must be a mapping")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "name: c\nnodes: [{devices: 2}]\ndevise: {memory_gb: 80}\n",
            r"c\.yaml: unknown key 'devise' \(did you mean device\?\); "
            r"known keys: bandwidth, device",
        ),
        ("nodes: [{devices: 2, gpus: 8}]\n", r"c\.yaml: nodes\[0\]: unknown key 'gpus'"),
        (
            "nodes: [{devices: [{memory_gb: 80, tflops: 1, sped: 0.5}]}]\n",
            r"nodes\[0\]\.devices\[0\]: unknown key 'sped' \(did you mean speed\?\)",
        ),
        (
            "nodes: {count: 2, devices: 4, gpu: 1}\ndevice: {memory_gb: 1, tflops: 1}\n",
            r"nodes: unknown key 'gpu'",
        ),
        (
            "nodes: [{devices: 1}]\nbandwidth: {intra_gbs: 1}\n",
            r"bandwidth: unknown key 'intra_gbs'",
        ),
    ],
)
def test_cluster_spec_names_an_unknown_key(tmp_path, text, message):
    from resihp.plan.specs import ClusterSpec

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        ClusterSpec.from_yaml(path)


def test_model_spec_names_an_unknown_key(tmp_path):
    from resihp.plan.specs import ModelSpec

    path = tmp_path / "m.yaml"
    path.write_text(
        "layers: 2\nhidden: 64\nheads: 2\nffn_hidden: 256\nvocab: 100\nmax_seq_len: 64\n"
        "global_batch_tokens: 128\nmicrobatch_tokens: 64\nmicro_batch_tokens: 32\n"
    )
    with pytest.raises(
        InputError,
        match=r"m\.yaml: unknown key 'micro_batch_tokens' \(did you mean "
        r"microbatch_tokens\?\)",
    ):
        ModelSpec.from_yaml(path)


def test_job_meta_refuses_a_typo_and_keeps_foreign_fields(tmp_path):
    from resihp.opstrace import read_meta

    path = tmp_path / "job.yaml"
    path.write_text("dp_size: 2\npp_size: 1\ntp_size: 1\nworld_size: 2\nvpp_szie: 2\n")
    with pytest.raises(
        InputError, match=r"job\.yaml: unknown key 'vpp_szie' \(did you mean vpp_size\?\)"
    ):
        read_meta(path)
    path.write_text("dp_size: 2\npp_size: 1\ntp_size: 1\nworld_size: 2\ncluster_name: pai-17\n")
    assert (
        read_meta(path)[1]["cluster_name"] == "pai-17"
    )  # a public trace's own field loads unchanged


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """PyYAML keeps the last of two values for one key without a word (a model of ``layers: 4``
    then ``layers: 8`` planned 8 layers); every loader of resihp refuses it, the replay's too."""
    from resihp.replay.yamlsrc import load_yaml

    path = tmp_path / "twice.yaml"
    path.write_text("name: m\nlayers: 4\nnested: {a: 1, b: 2}\nlayers: 8\n")
    with pytest.raises(
        InputError, match=r"twice\.yaml:4: not valid YAML \(key 'layers' given twice"
    ):
        read_yaml_mapping(path, "model", "must be a mapping")
    with pytest.raises(InputError, match="key 'layers' given twice"):
        load_yaml(path)
    path.write_text("a: {x: 1, x: 2}\n")  # in a nested mapping too
    with pytest.raises(InputError, match=r"twice\.yaml:1: .*key 'x' given twice"):
        read_yaml_mapping(path, "model", "must be a mapping")
