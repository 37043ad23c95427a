"""Per-class statistics payloads and their collector, on numbers checked by hand."""

import torch

from fl_lightning.knowledge.banks import ClassBank
from fl_lightning.knowledge.class_stats import ABSENT, ClassStatistics, ClassStatsCollector


def test_collector_divides_sums_by_counts_or_counts_plus_one():
    collector = ClassStatsCollector(3, {"logits": 2})
    collector.add(torch.tensor([0, 0, 2]), logits=torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    collector.add(torch.tensor([2]), logits=torch.tensor([[7.0, 8.0]]))
    mean = collector.result("class_logits")
    assert mean.vectors["logits"].tolist() == [[2.0, 3.0], [0.0, 0.0], [6.0, 7.0]]
    assert mean.labels.tolist() == [0, ABSENT, 2] and mean.labels.dtype == torch.int32
    plus_one = collector.result("class_logits", plus_one=True)  # FedHe eq. 8: sums / (V + 1)
    expected = torch.tensor([[4.0 / 3, 2.0], [0.0, 0.0], [4.0, 14.0 / 3]])  # [4, 6] / 3 and [12, 14] / 3
    assert torch.allclose(plus_one.vectors["logits"], expected)


def test_padded_and_compact_sizes_count_what_is_sent():
    collector = ClassStatsCollector(10, {"features": 8, "logits": 10})
    collector.add(torch.tensor([1, 4]), features=torch.ones(2, 8), logits=torch.ones(2, 10))
    padded = collector.result("class_knowledge")
    assert padded.nbytes == 10 * (8 + 10) * 4 + 10 * 4  # C rows of both vectors plus C int32 labels
    compact = padded.compact()
    assert compact.labels.tolist() == [1, 4]
    assert compact.nbytes == 2 * (8 + 10 + 1) * 4  # S x (D + 1) numbers (FedGH's LARs)


def test_bank_takes_padded_and_compact_uploads_alike():
    bank = ClassBank(3, 2)
    compact = ClassStatistics("x", {"v": torch.tensor([[2.0, 2.0]])}, torch.tensor([2], dtype=torch.int32))
    bank.add_statistics(compact, "v")
    rows = torch.tensor([[9.0, 9.0], [1.0, 1.0], [4.0, 6.0]])  # class 0 is padding: its row must be ignored
    padded = ClassStatistics.padded("x", {"v": rows}, torch.tensor([False, True, True]))
    bank.add_statistics(padded, "v")
    assert bank.available.tolist() == [False, True, True]
    assert bank.mean().tolist() == [[0.0, 0.0], [1.0, 1.0], [3.0, 4.0]]  # class 2: (2 + 4) / 2, (2 + 6) / 2
