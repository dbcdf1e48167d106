"""Sealed compaction items: what this server sealed opens for its tenant and model only; a changed byte,
another tenant, another model or another secret is a 400; the secret kept in a directory outlives a process."""

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.compaction.sealing import Compaction, Sealer, server_secret
from kvserve.server.compaction.summary import SUMMARY_HEADER, compacted_instructions, summary_turns
from kvserve.tools.rendering import Turn


def test_an_item_opens_for_its_tenant_and_model_and_hides_its_text():
    sealer = Sealer(b"s" * 32)
    sealed = sealer.seal(Compaction("The code word is heron.", "alice", "tiny"))
    assert "heron" not in sealed
    assert sealer.open(sealed, "alice", "tiny").summary == "The code word is heron."
    for tenant, model in (("bob", "tiny"), ("alice", "other-model")):
        with pytest.raises(InvalidRequestError, match="not one this server issued"):
            sealer.open(sealed, tenant, model)
    with pytest.raises(InvalidRequestError, match="not one this server issued"):
        Sealer(b"t" * 32).open(sealed, "alice", "tiny")


@pytest.mark.parametrize("position", [0, 5, 30, -10, -1])
def test_a_changed_character_or_a_forgery_is_refused(position):
    sealer = Sealer(b"s" * 32)
    sealed = sealer.seal(Compaction("summary", "alice", "tiny"))
    changed = list(sealed)
    changed[position] = "A" if changed[position] != "A" else "B"
    for forged in ("".join(changed), "", "not base64 at all!", sealed[:20]):
        with pytest.raises(InvalidRequestError, match="not one this server issued") as refused:
            sealer.open(forged, "alice", "tiny", param="input")
        assert refused.value.param == "input"


def test_the_secret_kept_in_a_directory_is_the_same_after_a_restart(tmp_path):
    first = server_secret(None, tmp_path)
    assert server_secret(None, tmp_path) == first and len(first) == 32
    assert (tmp_path / "compaction-secret").stat().st_mode & 0o777 == 0o600
    assert server_secret("x" * 16, tmp_path) == b"x" * 16  # a configured one wins
    assert server_secret(None, None) != server_secret(None, None)  # none kept: random per process


def test_a_compacted_history_is_the_instructions_then_the_summary():
    assert compacted_instructions("Be brief.", "They met.") == f"Be brief.\n\n{SUMMARY_HEADER}\nThey met."
    assert compacted_instructions(None, "They met.") == f"{SUMMARY_HEADER}\nThey met."
    assert compacted_instructions("Be brief.", None) == "Be brief."
    # the pass's request joins a trailing user turn (templates that alternate roles), else follows the answer
    turns = summary_turns([Turn("user", "Hi"), Turn("assistant", "Hello")])
    assert [t.role for t in turns] == ["user", "assistant", "user"]
    joined = summary_turns([Turn("user", "Hi")], "Sum up.")
    assert [(t.role, t.content) for t in joined] == [("user", "Hi\n\nSum up.")]
