"""SFT batches: shift and padding, packing, seeded epochs, and exact resume."""

import json

import datasets
import pytest
import torch

from forge.sft.batches import SFTDataLoader, eval_batches

PAD_ID = 0
LENGTHS = [5, 9, 3, 7, 4, 8, 6]


def make_examples():
    """Example i has tokens 100*(i+1) + t, so each token names its example and position,
    and a document starts exactly where a token id is a multiple of 100."""
    examples = []
    for index, length in enumerate(LENGTHS):
        input_ids = [100 * (index + 1) + position for position in range(length)]
        loss_mask = [int(position >= length // 2) for position in range(length)]
        examples.append({"input_ids": input_ids, "loss_mask": loss_mask})
    return examples


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "tokenized.parquet"
    datasets.Dataset.from_list(make_examples()).to_parquet(str(path))
    return datasets.load_dataset("parquet", data_files=str(path), split="train")


def loader(dataset, **overrides):
    options = {"batch_size": 3, "pad_id": PAD_ID, "max_seq_len": 16, "seed": 7} | overrides
    return SFTDataLoader(dataset, **options)


def rows_of(batch):
    """Undo the shift: the full token rows and their per-token loss masks."""
    tokens = torch.cat([batch["input_ids"][:, :1], batch["target_ids"]], dim=1)
    mask = torch.cat([torch.zeros_like(batch["loss_mask"][:, :1]), batch["loss_mask"]], dim=1)
    return tokens, mask


def test_unpacked_batch_is_shifted_and_padded(dataset):
    examples = make_examples()
    batch = next(loader(dataset, shuffle=False))

    assert batch["input_ids"].shape == batch["target_ids"].shape == batch["loss_mask"].shape == (3, 8)
    assert batch["loss_mask"].dtype == torch.float32
    for row, example in enumerate(examples[:3]):
        length = len(example["input_ids"])
        assert batch["input_ids"][row, : length - 1].tolist() == example["input_ids"][:-1]
        assert batch["target_ids"][row, : length - 1].tolist() == example["input_ids"][1:]
        assert batch["loss_mask"][row, : length - 1].tolist() == example["loss_mask"][1:]
        assert (batch["target_ids"][row, length - 1 :] == PAD_ID).all()
        assert (batch["loss_mask"][row, length - 1 :] == 0).all()


def test_each_epoch_visits_every_example_once_in_its_own_seeded_order(dataset):
    def first_tokens(data_loader, count):
        return [next(data_loader)["input_ids"][0, 0].item() for _ in range(count)]

    seen = first_tokens(loader(dataset, batch_size=1), 2 * len(LENGTHS))
    epoch_0, epoch_1 = seen[: len(LENGTHS)], seen[len(LENGTHS) :]
    starts = [100 * (index + 1) for index in range(len(LENGTHS))]
    assert sorted(epoch_0) == sorted(epoch_1) == starts
    assert epoch_0 != epoch_1
    assert seen == first_tokens(loader(dataset, batch_size=1), 2 * len(LENGTHS))
    assert first_tokens(loader(dataset, batch_size=1, shuffle=False), len(LENGTHS)) == starts


def test_packed_rows_hold_whole_documents_with_exact_masks(dataset):
    examples = {example["input_ids"][0]: example for example in make_examples()}
    max_seq_len = 16
    packed = loader(dataset, packing=True, batch_size=2, max_seq_len=max_seq_len)
    one_by_one = loader(dataset, batch_size=1, max_seq_len=max_seq_len)

    rows = []
    for _ in range(6):
        tokens, mask = rows_of(next(packed))
        assert tokens.shape == (2, max_seq_len)
        rows += list(zip(tokens.tolist(), mask.tolist(), strict=True))

    documents_in_order = []
    for tokens, mask in rows:
        starts = [position for position, token in enumerate(tokens) if token != PAD_ID and token % 100 == 0]
        used = sum(token != PAD_ID for token in tokens)
        assert starts[0] == 0 and tokens[used:] == [PAD_ID] * (max_seq_len - used)
        assert not any(mask[used:])
        for start, end in zip(starts, [*starts[1:], used], strict=True):
            example = examples[tokens[start]]
            assert tokens[start:end] == example["input_ids"]
            assert mask[start:end] == example["loss_mask"]
            documents_in_order.append(tokens[start])
    # Greedy packing keeps the loader's order: the documents are the unpacked sequence.
    assert documents_in_order == [next(one_by_one)["input_ids"][0, 0].item() for _ in documents_in_order]
    # A row closes only when the next document does not fit.
    for (tokens, _), (next_tokens, _) in zip(rows, rows[1:], strict=False):
        used = sum(token != PAD_ID for token in tokens)
        assert used + len(examples[next_tokens[0]]["input_ids"]) > max_seq_len


@pytest.mark.parametrize("packing", [False, True])
def test_resumed_run_sees_the_same_batches_as_a_straight_run(dataset, packing):
    batches = 3
    straight = loader(dataset, packing=packing)
    expected = [next(straight) for _ in range(2 * batches)]

    first = loader(dataset, packing=packing)
    for _ in range(batches):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(dataset, packing=packing)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(batches)]

    assert state["epoch"] < resumed.state_dict()["epoch"], "the resumed span must cross an epoch boundary"
    for want, have in zip(expected[batches:], got, strict=True):
        assert want.keys() == have.keys()
        assert all(torch.equal(want[key], have[key]) for key in want)


def test_load_state_dict_rejects_a_state_that_does_not_fit(dataset):
    data_loader = loader(dataset)
    with pytest.raises(KeyError, match="position"):
        data_loader.load_state_dict({"epoch": 0, "seed": 7})
    with pytest.raises(ValueError, match="outside the dataset"):
        data_loader.load_state_dict({"epoch": 0, "position": len(LENGTHS), "seed": 7})


def test_packing_rejects_an_example_longer_than_a_row(dataset):
    with pytest.raises(ValueError, match="more than max_seq_len=8"):
        next(loader(dataset, packing=True, max_seq_len=8, shuffle=False))


def test_eval_batches_cover_the_split_once_in_order(dataset):
    batches = list(eval_batches(dataset, batch_size=3, pad_id=PAD_ID))
    assert [len(batch["input_ids"]) for batch in batches] == [3, 3, 1]
    firsts = [token for batch in batches for token in batch["input_ids"][:, 0].tolist()]
    assert firsts == [100 * (index + 1) for index in range(len(LENGTHS))]
