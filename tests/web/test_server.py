"""`rtserver serve` as a process: a model that cannot be loaded ends it with a clear message."""

from __future__ import annotations

from rtbench.loadtest import phase_load_failure


def test_model_load_failure_exits_with_a_message_naming_the_file(tmp_path):
    outcomes = phase_load_failure(tmp_path)
    assert set(outcomes) == {"missing file", "corrupt file"}
    for name, out in outcomes.items():
        assert out["exit_code"] == 3, (name, out)
        assert out["names_file"] and not out["traceback"], (name, out)
    assert "no such GGUF file" in outcomes["missing file"]["message"]
    assert "not a readable GGUF model" in outcomes["corrupt file"]["message"]
