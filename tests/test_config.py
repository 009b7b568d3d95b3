"""defaults < kiln.toml < KILN_<SECTION>_<FIELD> < flags; clear errors for what is wrong."""

import pytest

from kiln.supervisor.core.config import ConfigError, load_config


def _file(tmp_path, text):
    p = tmp_path / "kiln.toml"
    p.write_text(text)
    return str(p)


def test_precedence_and_sources(tmp_path):
    f = _file(tmp_path, "[server]\nport = 9001\nhost = '0.0.0.0'\n[supervisor]\nliveness = 4\n")
    c = load_config(f, cli={"server.port": 9003}, env={"KILN_SERVER_HOST": "127.0.0.2",
                                                        "KILN_SUPERVISOR_LIVENESS": "5"})
    assert (c["server"]["port"], c.sources["server.port"]) == (9003, "cli")
    assert (c["server"]["host"], c.sources["server.host"]) == ("127.0.0.2", "env")
    assert (c["supervisor"]["liveness"], c.sources["supervisor.liveness"]) == (5, "env")
    assert c.sources["server.api_key"] == "default"
    assert c.as_dict()["server"]["port"] == {"value": 9003, "source": "cli"}


@pytest.mark.parametrize("text,match", [
    ("[server]\nportt = 1\n", r"unknown key\(s\) server.portt; allowed in \[server\]: host, port"),
    ("[servr]\n", r"unknown section\(s\) \['servr'\]"),
    ("[server]\nport = 'x'\n", r"server.port = 'x' is not valid: must be an int"),
    ("[server]\nport = 70000\n", r"out of range"),
    ("[workers.a]\nmodel = 'x'\n", r"\[workers.a\] needs a kind"),
    ("[workers.a]\nkind = 'inference'\ncolour = 'red'\n", r"unknown key\(s\) \['colour'\]"),
    ("[workers.a]\nkind = 'mystery'\n", r"kind 'mystery' is not built in"),
    ("[workers.a]\nkind = 'inference'\nsettings = { draft_modle = 'x' }\n",
     r"unknown setting\(s\) \['draft_modle'\] for kind 'inference'; allowed — ctx: .*draft_model: "),
    ("[workers.a]\nkind = 'moe-stream'\nsettings = { expert_cahce = '25%' }\n", r"allowed — .*expert_cache: "),
    ("[workers.a]\nkind = 'evaluator'\nsettings = { parallel = 2 }\n", r"for kind 'evaluator'; allowed — none"),
    ("not toml at all [[[", r"not valid TOML"),
    ("[models]\nweights = 'shared'\n", r"models.weights = 'shared' is not valid: must be one of 'mapped', 'private'"),
])
def test_bad_files_name_the_key_and_what_is_allowed(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_file(tmp_path, text), env={})


def test_bad_environment_values_are_named():
    with pytest.raises(ConfigError, match="KILN_SUPERVISOR_LIVENESS"):
        load_config(env={"KILN_SUPERVISOR_LIVENESS": "often"})
    with pytest.raises(ConfigError, match="KILN_SERVER_PROT names no setting"):
        load_config(env={"KILN_SERVER_PROT": "1"})


def test_default_workers_serve_the_default_model():
    c = load_config(env={})
    assert c.workers["default"]["kind"] == "inference" and c.workers["default"]["model"] == "default"


def test_a_custom_kind_gets_its_settings_unchecked_and_built_in_ones_known_settings(tmp_path):
    c = load_config(_file(tmp_path, "[workers.a]\nkind = 'mine'\nmodule = 'my.mod'\nsettings = { anything = 1 }\n"
                                   "[workers.b]\nkind = 'moe-stream'\nsettings = { expert_cache = 'auto', ctx = 2048 }\n"
                                   "[workers.c]\nkind = 'inference'\nsettings = { weights = 'private' }\n"),
                    env={})
    assert c.workers["a"]["settings"] == {"anything": 1} and c.workers["b"]["settings"]["ctx"] == 2048
    assert c.workers["c"]["settings"] == {"weights": "private"}
