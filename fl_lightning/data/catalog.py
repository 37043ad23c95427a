"""Where every benchmark's files come from: the published files (URLs and checksums) or pinned Hugging Face
Hub commits of each data set and of the pretrained ViT, what a loader expects under ``data_dir``, and the
names ``flrun data fetch`` knows them by.

Checksums are the publishers' or the standard loaders' (torchvision, torchaudio / TensorFlow Datasets,
TensorFlow Federated); Hub data sets are pinned to a commit and every file is checked against the
SHA-256 the Hub lists for that commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..federation.errors import ConfigError
from ..federation.pins import VIT_ID, VIT_REVISION


@dataclass(frozen=True)
class Remote:
    """One published file: ``name`` is where it goes under ``data_dir``; archives are unpacked into
    ``extract_to`` (under ``data_dir``) and then deleted."""

    url: str
    name: str
    sha256: str | None = None
    md5: str | None = None
    git_sha1: str | None = None
    extract_to: str | None = None


@dataclass(frozen=True)
class HubFiles:
    """Files of a Hugging Face data set at a pinned commit, copied flat into ``folder`` (under data_dir)."""

    repo_id: str
    revision: str | None  # None: no commit could be pinned here; fetch records the one it used
    patterns: tuple[str, ...]
    folder: str
    listing: str = ""  # the repository folder to list (large repositories)


@dataclass(frozen=True)
class Source:
    """A data set's files under ``data_dir`` (``expected``: paths that must exist, glob patterns allowed),
    a readable ``layout``, where they come from (``origin``) and how :func:`fetch` gets them."""

    name: str
    title: str
    expected: tuple[str, ...]
    layout: str
    origin: str
    remotes: tuple[Remote, ...] = ()
    hub: HubFiles | None = None
    aliases: tuple[str, ...] = field(default=())


CIFAR = "https://www.cs.toronto.edu/~kriz/"
MNIST = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's https mirror
TFF = "https://storage.googleapis.com/tff-datasets-public/"
VIT_FOLDER = f"pretrained/{VIT_ID.replace('/', '--')}"

SOURCES = (
    Source(
        "cifar10",
        "CIFAR-10",
        tuple(f"cifar-10-batches-py/{n}" for n in ["data_batch_1", "data_batch_2", "data_batch_3"])
        + tuple(f"cifar-10-batches-py/{n}" for n in ["data_batch_4", "data_batch_5", "test_batch"]),
        "cifar-10-batches-py/{data_batch_1..5,test_batch}",
        f"the python version, {CIFAR}cifar-10-python.tar.gz",
        (
            Remote(
                f"{CIFAR}cifar-10-python.tar.gz",
                "cifar-10-python.tar.gz",
                md5="c58f30108f718f92721af3b95e74349a",
                extract_to=".",
            ),
        ),
        aliases=("Cifar10Data",),
    ),
    Source(
        "cifar100",
        "CIFAR-100",
        ("cifar-100-python/train", "cifar-100-python/test"),
        "cifar-100-python/{train,test}",
        f"the python version, {CIFAR}cifar-100-python.tar.gz",
        (
            Remote(
                f"{CIFAR}cifar-100-python.tar.gz",
                "cifar-100-python.tar.gz",
                md5="eb9058c3a382ffc7106e4002c42a8d85",
                extract_to=".",
            ),
        ),
        aliases=("Cifar100Data",),
    ),
    Source(
        "mnist",
        "MNIST",
        tuple(
            f"MNIST/raw/{n}-ubyte.gz"
            for n in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")
        ),
        "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
        f"torchvision's mirror {MNIST}",
        tuple(
            Remote(f"{MNIST}{n}-ubyte.gz", f"MNIST/raw/{n}-ubyte.gz", md5=md5)
            for n, md5 in (
                ("train-images-idx3", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                ("train-labels-idx1", "d53e105ee54ea40749a09fcbcd1e9432"),
                ("t10k-images-idx3", "9fb629c4189551a2d022fa330f9573f3"),
                ("t10k-labels-idx1", "ec29112dd5afa0611ce80d1b7f02629c"),
            )
        ),
        aliases=("MnistData",),
    ),
    Source(
        "cinic10",
        "CINIC-10",
        ("CINIC-10/train/*/*.png", "CINIC-10/test/*/*.png"),
        "CINIC-10/{train,test}/<class>/*.png",
        "https://datashare.ed.ac.uk/handle/10283/3192 (CINIC-10.tar.gz)",
        (
            Remote(
                "https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz",
                "CINIC-10.tar.gz",
                sha256="31b095acf6d75e25a9e028bae82a07a0f94ff6b00671be2802d34ac4efa81a9e",
                extract_to="CINIC-10",
            ),
        ),
        aliases=("Cinic10Data",),
    ),
    Source(
        "speech_commands",
        "Speech Commands v0.02",
        ("speech_commands_v0.02/testing_list.txt", "speech_commands_v0.02/*/*_nohash_*.wav"),
        "speech_commands_v0.02/{testing_list.txt,<word>/<speaker>_nohash_<k>.wav}",
        "https://storage.googleapis.com/download.tensorflow.org/data/speech_commands_v0.02.tar.gz",
        (
            Remote(
                "https://storage.googleapis.com/download.tensorflow.org/data/speech_commands_v0.02.tar.gz",
                "speech_commands_v0.02.tar.gz",
                sha256="af14739ee7dc311471de98f5f9d2c9191b18aedfe957f4a6ff791c709868ff58",
                extract_to="speech_commands_v0.02",
            ),
        ),
        aliases=("SpeechCommandsData", "speech"),
    ),
    Source(
        "fed_cifar100",
        "Federated CIFAR-100",
        ("fed_cifar100/fed_cifar100_train.h5", "fed_cifar100/fed_cifar100_test.h5"),
        "fed_cifar100/fed_cifar100_{train,test}.h5",
        f"TensorFlow Federated, {TFF}fed_cifar100.tar.bz2",
        (
            Remote(
                f"{TFF}fed_cifar100.tar.bz2",
                "fed_cifar100/fed_cifar100.tar.bz2",
                sha256="e8575e22c038ecef1ce6c7d492d7abee7da13b1e1ba9b70a7fc18531ba7590de",
                extract_to="fed_cifar100",
            ),
        ),
        aliases=("FedCifar100Data",),
    ),
    Source(
        "stackoverflow",
        "StackOverflow",
        (
            "stackoverflow/stackoverflow_train.h5",
            "stackoverflow/stackoverflow_test.h5",
            "stackoverflow/stackoverflow.word_count",
        ),
        "stackoverflow/{stackoverflow_train.h5,stackoverflow_test.h5,stackoverflow.word_count}",
        f"TensorFlow Federated, {TFF}stackoverflow.tar.bz2 and stackoverflow.word_count.tar.bz2",
        (
            Remote(
                f"{TFF}stackoverflow.word_count.tar.bz2",
                "stackoverflow/stackoverflow.word_count.tar.bz2",
                sha256="1dc00256d6e527c54b9756d968118378ae14e6692c0b3b6cad470cdd3f0c519c",
                extract_to="stackoverflow",
            ),
            Remote(
                f"{TFF}stackoverflow.tar.bz2",
                "stackoverflow/stackoverflow.tar.bz2",
                sha256="99eca2f8b8327a09e5fc123979df2d237acbc5e52322f6d86bf523ee47b961a2",
                extract_to="stackoverflow",
            ),
        ),
        aliases=("StackOverflowData",),
    ),
    Source(
        "femnist",
        "FEMNIST",
        ("femnist/hub/*.parquet",),
        "femnist/hub/*.parquet (the Hub's flwrlabs/femnist) or LEAF's femnist/all_data/*.json",
        "the Hugging Face data set flwrlabs/femnist (or LEAF's preprocess.sh)",
        hub=HubFiles("flwrlabs/femnist", None, ("*.parquet",), "femnist/hub"),
        aliases=("FemnistData",),
    ),
    Source(
        "imdb",
        "IMDB",
        ("imdb/train-*.parquet", "imdb/test-*.parquet", "imdb/unsupervised-*.parquet"),
        "imdb/{train,test,unsupervised}-*.parquet",
        "the Hugging Face data set stanfordnlp/imdb",
        hub=HubFiles("stanfordnlp/imdb", "e6281661ce1c48d982bc483cf8a173c1bbeb5d31", ("plain_text/*.parquet",), "imdb"),
        aliases=("ImdbData",),
    ),
    Source(
        "c4",
        "C4 validation shard",
        ("c4/c4-validation.00000-of-00008.json.gz",),
        "c4/c4-validation.00000-of-00008.json.gz",
        "the Hugging Face data set allenai/c4 (en)",
        hub=HubFiles("allenai/c4", None, ("en/c4-validation.00000-of-00008.json.gz",), "c4", listing="en"),
    ),
    Source(
        "vit_b16",
        "ViT-B/16 weights",
        (f"{VIT_FOLDER}/config.json", f"{VIT_FOLDER}/model.safetensors"),
        f"{VIT_FOLDER}/{{config.json,model.safetensors}}",
        f"the Hugging Face model {VIT_ID} at commit {VIT_REVISION}",
        tuple(
            Remote(f"https://huggingface.co/{VIT_ID}/resolve/{VIT_REVISION}/{name}", f"{VIT_FOLDER}/{name}", **check)
            for name, check in (
                ("config.json", {"git_sha1": "254071bbf72dd0fd535b61768d9cd87adcb776f4"}),
                ("model.safetensors", {"sha256": "fd4e1169c7aa6c2dbfa8a6448be13b35abc0ee256190857c90009d12c094619b"}),
            )
        ),
        aliases=("vit", VIT_ID),
    ),
)
NAMES = {key.lower(): source for source in SOURCES for key in (source.name, *source.aliases)}


def source(name: str) -> Source:
    """A data set's source by short name (``cifar10``) or class name (``Cifar10Data``)."""
    found = NAMES.get(name.lower())
    if found is None:
        raise ConfigError(
            f"unknown data set {name!r} for `flrun data fetch`; use one of {', '.join(s.name for s in SOURCES)}."
        )
    return found
