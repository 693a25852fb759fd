"""contrastive_dist.lightning's recipe parts (towers, views, k-NN, momentum) against plain references."""

from __future__ import annotations

import math

import pytest
import torch

from contrastive_dist import DistributedInfoNCE, DistributedMemoryQueue, info_nce
from contrastive_dist.lightning.image_text import CaptionCollate, caption_id
from contrastive_dist.lightning.knn import KnnSplit, knn_accuracy, majority_rate, split_knn_accuracy
from contrastive_dist.lightning.labelled_images import LabelledImages, shapes_splits
from contrastive_dist.lightning.momentum import momentum_contrast_loss, momentum_copy, momentum_update_
from contrastive_dist.lightning.towers import ByteTokenizer, TextTransformer, projection_head, small_image_resnet
from contrastive_dist.lightning.views import TwoViews, image_collate, simclr_augment


def reference_knn(bank, bank_labels, queries, query_labels, classes, k, temperature) -> float:
    right = 0
    for query, label in zip(queries.double(), query_labels.tolist()):
        similarity = [(float(query @ row), int(bank_label)) for row, bank_label in zip(bank.double(), bank_labels)]
        votes = [0.0] * classes
        for value, bank_label in sorted(similarity, reverse=True)[:k]:
            votes[bank_label] += math.exp(value / temperature)
        right += max(range(classes), key=votes.__getitem__) == label
    return right / len(queries)


@pytest.mark.parametrize(("bank_size", "k"), [(1, 20), (7, 3), (30, 20)])
def test_knn_accuracy_is_the_weighted_vote_of_the_nearest(bank_size: int, k: int) -> None:
    generator = torch.Generator().manual_seed(bank_size)
    bank = torch.nn.functional.normalize(torch.randn(bank_size, 4, generator=generator), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(9, 4, generator=generator), dim=1)
    bank_labels, query_labels = torch.randint(3, (bank_size,), generator=generator), torch.randint(3, (9,))
    expected = reference_knn(bank, bank_labels, queries, query_labels, 3, k, 0.1)
    assert knn_accuracy(bank, bank_labels, queries, query_labels, classes=3, k=k) == pytest.approx(expected)
    split = torch.cat([torch.zeros(bank_size), torch.ones(9)]).long()
    features, labels = torch.cat([bank, queries]), torch.cat([bank_labels, query_labels])
    assert split_knn_accuracy(features, labels, split, classes=3, k=k) == pytest.approx(expected)


def test_knn_split_and_majority_rate() -> None:
    split = KnnSplit([("b0", 1), ("b1", 2)], [("q0", 0)])
    assert [split[i] for i in range(len(split))] == [("b0", 1, 0), ("b1", 2, 0), ("q0", 0, 1)]
    assert majority_rate(torch.tensor([3, 3, 3, 1]), classes=5) == 0.75


def test_momentum_update_is_the_ema_and_the_queue_loss_is_the_mean_of_both_directions() -> None:
    torch.manual_seed(0)
    query_encoder = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    key_encoder = momentum_copy(query_encoder)
    assert not any(p.requires_grad for p in key_encoder.parameters())
    with torch.no_grad():
        for parameter in query_encoder.parameters():
            parameter.add_(torch.randn_like(parameter))
    before = [p.clone() for p in key_encoder.parameters()]
    momentum_update_(key_encoder, query_encoder, momentum=0.9)
    for key, old, query in zip(key_encoder.parameters(), before, query_encoder.parameters()):
        torch.testing.assert_close(key, 0.9 * old + 0.1 * query)
    with pytest.raises(ValueError, match=r"momentum in \[0, 1\), got 1"):
        momentum_update_(key_encoder, query_encoder, momentum=1.0)
    with pytest.raises(ValueError, match="query encoder's parameters"):
        momentum_update_(torch.nn.Linear(3, 4), query_encoder, momentum=0.5)

    queue = DistributedMemoryQueue(6, 4, dtype=torch.float64)
    queue.enqueue(torch.nn.functional.normalize(torch.randn(2, 4, dtype=torch.float64), dim=1))
    queries = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(2, 3, 4, dtype=torch.float64)
    unit_q, unit_k = (torch.nn.functional.normalize(x, dim=-1) for x in (queries, keys))
    negatives = queue.negatives
    expected = (info_nce(unit_q[0], unit_k[1], symmetric=False, negatives=negatives)
                + info_nce(unit_q[1], unit_k[0], symmetric=False, negatives=negatives)) / 2
    loss = momentum_contrast_loss(DistributedInfoNCE(symmetric=False), queries, keys, queue)
    torch.testing.assert_close(loss, expected)
    assert len(queue) == 5  # then the second view's keys joined the queue
    assert all(torch.isclose(queue.memory, row).all(dim=1).any() for row in unit_k[1])


def test_towers_take_empty_batches_and_keep_every_parameter_in_the_graph() -> None:
    tokens = ByteTokenizer(8)(["héllo", "a much longer caption"])
    assert tokens.shape == (2, 8) and tokens[1, -1] == ByteTokenizer.end and tokens[0, 0] == ByteTokenizer.begin
    text = TextTransformer(width=8, context_length=8, heads=2)
    empty = text(ByteTokenizer(8)([]))
    assert empty.shape == (0, 8)
    empty.sum().backward()
    assert all(p.grad is not None for p in text.parameters())
    for norm in ("batch", "group"):
        net, features = small_image_resnet("resnet-small", width=4, norm=norm)
        assert net(torch.zeros(2, 3, 16, 16)).shape == (2, features) == (2, 32)
    with pytest.raises(ValueError, match="norm in"):
        small_image_resnet("resnet-small", norm="layer")
    assert projection_head(32, hidden=8, out=4)(torch.randn(3, 32)).shape == (3, 4)


def test_views_collate_and_labelled_splits() -> None:
    train, bank, queries, classes = shapes_splits(train_size=6, val_size=3, bank_size=4, image_size=16, seed=1)
    assert (len(train), len(bank), len(queries), classes) == (6, 4, 3, 5)
    assert [bank[i][1] for i in range(4)] == [train[i][1] for i in range(4)]
    plain = TwoViews(train, None)[2]
    assert torch.equal(plain[0], plain[1]) and plain[2] == 2
    torch.manual_seed(0)
    first, second, index = TwoViews(train, simclr_augment(16, min_crop=0.3, hue=0.5))[1]
    assert first.shape == second.shape == (3, 16, 16) and not torch.equal(first, second) and index == 1
    images, labels = image_collate([train[0], train[1]])
    assert images.dtype == torch.float32 and labels.tolist() == [train[0][1], train[1][1]]
    relabelled = LabelledImages([(torch.zeros(3, 2, 2, dtype=torch.uint8), 7)], [0], 2)
    assert relabelled[0][1] == 7
    items = [(torch.zeros(3, 2, 2, dtype=torch.uint8), "a cat", 5, 0)]
    assert CaptionCollate(8)(items)[2].tolist() == [caption_id("a cat")]
