"""`--site FILE`: a file with only the site mapping replaces the config's site section."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.core.errors import ConfigError
from hpcserve.site.files import load_site_file, load_with_site

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_site_file_replaces_the_config_site(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("runtime: apptainer\nimage: /img/x.sif\nbinds: [/scratch]\n")
    cfg = load_with_site(EXAMPLES / "slurm-llama-70b.yaml", site)
    assert cfg.site.runtime == "apptainer" and cfg.site.binds == ["/scratch"] and cfg.site.gres
    assert cfg.cluster.nodes == 2  # the rest of the config is untouched
    assert load_with_site(EXAMPLES / "site-no-gres.yaml", None).site.gres is False


def test_a_file_written_as_a_site_section_works_too(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site:\n  gres: false\n")
    assert load_site_file(site).gres is False


@pytest.mark.parametrize("text, words", [
    ("runtime: apptainer\n", ["site.runtime 'apptainer' needs site.image"]),
    ("runtime: docker\n", ["site.runtime", "docker"]),
    ("gres: false\nmodules: [x]\n", ["unknown key 'site.modules'", "runtime, image"]),
    ("- a\n- b\n", ["must be a mapping"]),
    ("runtime: [\n", ["not valid YAML"]),
])
def test_bad_site_files_are_one_message_naming_the_field(tmp_path, text, words):
    site = tmp_path / "site.yaml"
    site.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_site_file(site)
    for word in words:
        assert word in str(err.value)


def test_missing_site_file(tmp_path):
    with pytest.raises(ConfigError, match="no such site file"):
        load_site_file(tmp_path / "nope.yaml")
