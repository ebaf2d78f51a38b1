"""`voiced bench spark-env`'s modes (the bench itself needs a GPU): a mode naming a setting that nothing in voiced
reads, a misspelt switch say, is refused before anything runs, where it would have measured the default twice."""

from __future__ import annotations

import pytest

from voiced.bench.spark_env_ab import parse_mode


def test_modes_name_the_settings_the_engines_read():
    assert parse_mode("default") == {}
    assert parse_mode("VOICED_SPARK_PDL=0") == {"VOICED_SPARK_PDL": "0"}
    assert parse_mode("VOICED_SPARK_PDL=0,VOICED_SPARK_TOPK_KERNEL=0") == {
        "VOICED_SPARK_PDL": "0", "VOICED_SPARK_TOPK_KERNEL": "0"}


@pytest.mark.parametrize("mode", ["VOICED_SPARK_TOPK_KERNAL=0", "VOICED_SPARK_PDL=1,VOICED_SPARK_PLD=0"])
def test_a_misspelt_setting_is_refused_by_name(mode):
    with pytest.raises(SystemExit, match="no such setting"):
        parse_mode(mode)


def test_a_mode_that_is_not_name_value_pairs_is_refused():
    with pytest.raises(SystemExit, match="is not VAR=VALUE"):
        parse_mode("VOICED_SPARK_PDL")
