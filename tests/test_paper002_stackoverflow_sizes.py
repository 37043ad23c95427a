"""Paper 002's StackOverflow data sizes (Tables 1, 3, 4 and 5), computed from each recipe's partition plan.

Table 3: the federated pool is 34,248 users with 13,567,778 posts, and the in-domain distillation set is
the 122,250,952 posts of the other users (13,567,778 + 122,250,952 = 135,818,730, all of TFF's training
posts): clients keep every post, and the server's posts come from users no client holds. Table 5: 30,000
questions-only users (P_H) and 30,000 answers-only users (P_L), disjoint, each keeping every post of its
pool's kind. Which users the paper drew is not published, so the example counts are checked as what
they are made of: each recipe runs its own ``setup`` on small h5 files of the real format, with its
user and client counts scaled down (``SCALE``), and every size is compared with the posts in the file.
"""

import gzip
import json

import pytest
import torch
from conftest import ROOT
from test_benchmark_data import write_tff

from fl_lightning.data import StackOverflowData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Population, Tier
from fl_lightning.run.recipes import load_recipe

# the recipes' user and client counts -> the small file's; a recipe with another count fails here (add it)
SCALE = {34_248: 12, 330: 2, 684: 3, 1_414: 4, 60_000: 12, 30_000: 6, 1_000_000: 20}
USERS, BIG_USER, BIG_POSTS, C4_DOCUMENTS = 40, "u007", 300, 5
WORDS = [f"w{i}" for i in range(10)]


def _posts(i: int) -> tuple[list[bytes], list[bytes]]:
    """User ``i``'s posts: 2 to 12 of them (user 7: 300, more than TFF's usual cap of 256), every third a question."""
    n = BIG_POSTS if f"u{i:03d}" == BIG_USER else 2 + (7 * i) % 11
    tokens = [f"{WORDS[i % 10]} {WORDS[j % 10]}".encode() for j in range(n)]
    return tokens, [b"question" if j % 3 == 0 else b"answer" for j in range(n)]


FILE = {f"u{i:03d}": _posts(i) for i in range(USERS)}
HIGH_CLIENTS = {"143k": 330, "296k": 684, "612k": 1_414}  # |P_H| (file name) -> high-capacity clients


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("so")
    folder = root / "stackoverflow"
    folder.mkdir()
    (folder / "stackoverflow.word_count").write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(WORDS)))
    write_tff(folder / "stackoverflow_train.h5", FILE, ("tokens", "type"))
    write_tff(
        folder / "stackoverflow_test.h5", {"t": ([b"w1 w2", b"w3"], [b"question", b"answer"])}, ("tokens", "type")
    )
    (root / "c4").mkdir()
    with gzip.open(root / "c4" / "c4-validation.00000-of-00008.json.gz", "wt") as f:
        for k in range(C4_DOCUMENTS + 3):
            f.write(json.dumps({"text": f"W{k % 10} w1", "url": "x", "timestamp": "y"}) + "\n")
    return root


def _recipes(pattern):
    return sorted(ROOT.glob(f"recipes/{pattern}.yaml"))


TABLE_1 = _recipes("fedadam_stackoverflow_ph*") + _recipes("*_codist_stackoverflow_ph*")
DOMAIN_SHIFT = _recipes("*_stackoverflow_domain_shift")


def _plan(path, data_dir, seed=0):
    """The recipe's data after ``setup`` at its scaled-down counts, with its clients (tier roles)."""
    recipe = load_recipe(path)
    args = dict(recipe["data"]["init_args"])
    for key in ("max_clients", "question_clients", "distillation_examples"):
        if args.get(key) is not None:
            args[key] = (
                C4_DOCUMENTS
                if key == "distillation_examples" and args.get("distillation_texts") == "hub"
                else SCALE[args[key]]
            )
    args.update(data_dir=str(data_dir), download=False, vocab_size=len(WORDS))
    data = StackOverflowData(**args)
    population = recipe["population"]
    tiers = [
        Tier(**{**tier, **({"count": SCALE[tier["count"]]} if "count" in tier else {})}) for tier in population["tiers"]
    ]
    clients = Population(SCALE[population["num_clients"]], tiers).build(seed)
    data.setup(len(clients), seed=seed)
    return data, clients


def _users(data):
    """Each client's user: every client must hold exactly one user's posts."""
    owners = [set(data.groups[c.train.numpy()]) for c in data.clients]
    assert all(len(o) == 1 for o in owners)
    return [o.pop() for o in owners]


def test_every_paper_002_stackoverflow_family_is_covered():
    assert len(TABLE_1) == 15  # 3 pool sizes x (FedAdam, 2 methods x in- / out-of-domain)
    assert [p.stem.split("_stackoverflow")[0] for p in DOMAIN_SHIFT] == ["fedadam", "merged_codist", "periodic_codist"]
    for path in TABLE_1 + DOMAIN_SHIFT:  # the full-scale counts the scaled plans stand for
        recipe = load_recipe(path)
        args = recipe["data"]["init_args"]
        assert args["max_clients"] == recipe["population"]["num_clients"]
        assert args["max_examples_per_client"] is None and args["pool_users"] == "random"
        assert args.get("server_fraction", 0.0) == 0.0  # never taken from the clients' users
    assert {load_recipe(p)["data"]["init_args"]["max_clients"] for p in TABLE_1} == {34_248}  # Table 3
    for path in DOMAIN_SHIFT:  # Table 5: 30,000 + 30,000 users
        recipe = load_recipe(path)
        assert recipe["data"]["init_args"]["question_clients"] == 30_000 == recipe["population"]["tiers"][0]["count"]
        assert recipe["population"]["num_clients"] == 60_000


@pytest.mark.parametrize("path", TABLE_1, ids=lambda p: p.stem)
def test_table_1_pools_keep_every_post_and_the_server_set_comes_from_other_users(path, data_dir):
    data, clients = _plan(path, data_dir)
    users = _users(data)
    sizes = [len(c.train) for c in data.clients]
    assert len(users) == 12 and sizes == [len(FILE[u][0]) for u in users]  # every post of every pool user
    assert sum(sizes) == sum(len(FILE[u][0]) for u in users)  # Table 3's pool examples, from the plan
    high = SCALE[HIGH_CLIENTS[path.stem.split("_ph")[1][:4]]]
    assert sum(1 for spec in clients if "large" in spec.roles) == high  # Table 4's high-capacity clients
    assert sum(s for s, spec in zip(sizes, clients) if "large" in spec.roles) == sum(
        len(FILE[u][0]) for u, spec in zip(users, clients) if "large" in spec.roles
    )
    pool_posts = sum(len(FILE[u][0]) for u in users)
    server = data.server_idx.numpy()
    if path.stem.endswith("_indomain"):
        assert len(server) == SCALE[1_000_000] and server.min() == pool_posts  # appended after the pool
        assert set(data.server_owners).isdisjoint(users)  # no client holds a distillation post
        assert bool((data.y[data.server_idx] == -100).all())  # unlabeled
    elif path.stem.endswith("_outdomain"):
        assert len(server) == C4_DOCUMENTS and server.min() == pool_posts
        assert data.server_owners is None
    else:
        assert len(server) == 0  # FedAdam has no distillation set


def test_no_cap_keeps_all_of_a_big_users_posts_where_tffs_usual_256_would_cut(data_dir):
    kept = StackOverflowData(
        data_dir=str(data_dir), vocab_size=len(WORDS), max_clients=None, max_examples_per_client=None
    )
    kept.setup(USERS, seed=0)
    capped = StackOverflowData(data_dir=str(data_dir), vocab_size=len(WORDS), max_clients=None)  # the class default
    capped.setup(USERS, seed=0)
    big = _users(kept).index(BIG_USER)
    assert len(kept.clients[big].train) == BIG_POSTS and len(capped.clients[big].train) == 256
    assert sum(len(c.train) for c in kept.clients) == sum(len(tokens) for tokens, _ in FILE.values())


@pytest.mark.parametrize("size", ["143k", "296k", "612k"])
def test_baseline_and_codistillation_rows_train_on_the_same_users_whatever_the_seed(size, data_dir):
    reference, _ = _plan(ROOT / f"recipes/fedadam_stackoverflow_ph{size}.yaml", data_dir)
    for path in _recipes(f"*_codist_stackoverflow_ph{size}_*"):
        for seed in (0, 1):  # pool_seed fixes the pool: the run's seed does not change it
            data, _ = _plan(path, data_dir, seed=seed)
            assert all(torch.equal(a.train, b.train) for a, b in zip(reference.clients, data.clients)), path.stem


@pytest.mark.parametrize("path", DOMAIN_SHIFT, ids=lambda p: p.stem)
def test_table_5_pools_are_disjoint_users_with_every_post_of_their_kind(path, data_dir):
    data, clients = _plan(path, data_dir)
    users = _users(data)
    assert len(set(users)) == 12
    kinds = data.post_types
    question_pool = [spec.tier == "high" for spec in clients]
    assert sum(question_pool) == 6 and next(spec.roles for spec in clients if spec.tier == "high") == ("large",)
    for client, user, asks in zip(data.clients, users, question_pool):
        kind = "question" if asks else "answer"
        assert set(kinds[client.train.numpy()]) == {kind}
        assert len(client.train) == sum(k.decode() == kind for k in FILE[user][1])  # all of them
    server = data.server_idx.numpy()
    if path.stem.startswith("fedadam"):
        assert len(server) == 0
        return
    assert len(server) == SCALE[1_000_000] and set(data.server_owners).isdisjoint(users)
    outside = [u for u in sorted(FILE) if u not in users]  # their posts in file order, the first 20 taken
    taken = [(u, k.decode()) for u in outside for k in FILE[u][1]][: len(server)]
    assert list(data.server_owners) == [u for u, _ in taken]
    assert {k for _, k in taken} == {"question", "answer"}  # both kinds, as the paper's distillation set


def test_outside_users_needs_users_left_and_excludes_other_server_sets(data_dir):
    small = {"data_dir": str(data_dir), "vocab_size": len(WORDS), "distillation_texts": "outside_users"}
    with pytest.raises(ConfigError, match="the 0 users outside it hold 0; lower distillation_examples or max_clients"):
        StackOverflowData(**small, max_clients=None).setup(4, seed=0)
    with pytest.raises(ConfigError, match="replaces server_fraction, server_examples and server_dataset"):
        StackOverflowData(**small, server_fraction=0.5)
    first = StackOverflowData(**small, max_clients=4, distillation_examples=10)
    first.setup(4, seed=0)
    assert _users(first) == ["u000", "u001", "u002", "u003"]  # pool_users: first, in file order
    assert list(first.server_owners) == ["u004"] * 8 + ["u005"] * 2  # then the next users' posts: 8 + 2 of 4
    assert first.x[first.server_idx][:, 1].tolist() == [5] * 8 + [6] * 2  # after bos: u004's w4, u005's w5
