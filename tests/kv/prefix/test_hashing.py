"""Stable block hashes: one digest per full block, identical across processes and hash seeds."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from kvserve.kv.prefix.hashing import BlockHashChain, block_hashes, chain_root, hash_block

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [5, 70000, 3, 128255, 9, 9, 1, 0, 42, 17]  # 2 full 4-token blocks + 2 tokens


def _hashes_in_subprocess(hash_seed: str) -> dict:
    code = ("import json, sys; from kvserve.kv.prefix.hashing import block_hashes; "
            "tokens, salt = json.loads(sys.argv[1]); chain = block_hashes(tokens, 4, salt); "
            "print(json.dumps({'root': chain.root.hex(), 'hashes': [h.hex() for h in chain.hashes], "
            "'python_hash': hash(('x', salt))}))")
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps([TOKENS, "tenant-a"])], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_two_processes_with_different_hash_seeds_agree():
    first, second = _hashes_in_subprocess("1"), _hashes_in_subprocess("2")
    assert first["python_hash"] != second["python_hash"]  # the seeds really differ: hash() would not agree
    chain = block_hashes(TOKENS, 4, "tenant-a")
    assert first["root"] == second["root"] == chain.root.hex()
    assert first["hashes"] == second["hashes"] == [h.hex() for h in chain.hashes]
    assert len(chain) == 2


def test_the_encoding_is_the_documented_one():
    """BLAKE2b-128 over parent hash, token count (u32 LE), token ids (i64 LE): a changed format breaks
    every stored tier, so it is pinned here (and by one literal digest)."""
    root = chain_root("tenant-a")
    expected = hashlib.blake2b(root + (4).to_bytes(4, "little")
                               + b"".join(t.to_bytes(8, "little", signed=True) for t in TOKENS[:4]),
                               digest_size=16, person=b"kvserve-block").digest()
    assert block_hashes(TOKENS, 4, "tenant-a").hashes[0] == expected == hash_block(root, TOKENS[:4])
    assert block_hashes(list(range(1, 9)), 4, "tenant").hashes[0].hex() == "f0ca4574f16bb4850595748b54f56f3b"


def test_salts_tokens_and_parents_all_change_the_hash():
    roots = {chain_root(None), chain_root(""), chain_root("a"), chain_root("b")}
    assert len(roots) == 4  # no salt and an empty salt are different tenants too
    base = block_hashes(TOKENS, 4, "a").hashes
    assert block_hashes(TOKENS, 4, "b").hashes[0] != base[0]
    assert block_hashes([6] + TOKENS[1:], 4, "a").hashes[1] != base[1]  # the first block differs: so does the chain
    assert hash_block(base[0], TOKENS[4:8], extra_keys=b"lora-1") != base[1]
    assert base[0] not in roots  # a block hash never equals a root


def test_chain_extends_as_tokens_arrive_and_matches_one_pass():
    chain = BlockHashChain(4, "a")
    tokens = []
    for token in TOKENS:
        tokens.append(token)
        chain.extend(tokens)
        assert len(chain) == len(tokens) // 4
    assert chain.hashes == block_hashes(TOKENS, 4, "a").hashes
    assert chain.parent(0) == chain.root and chain.parent(1) == chain.hashes[0]


def test_no_block_size_keeps_no_hashes():
    chain = BlockHashChain(None, "a")
    chain.extend(TOKENS)
    assert len(chain) == 0 and chain.root == chain_root("a")
