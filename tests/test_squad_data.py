"""finetune/squad.py: reading SQuAD JSON (bad input = one error naming the place), BERT features (doc-stride
windows, answer spans, v2.0 [CLS]) and span decoding on constructed logits."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import helpers
from common.errors import InputError
from data.squad_sample import sample_sentences, word_questions, write_squad
from finetune import squad
from finetune_helpers import REPO_ROOT

VOCAB = REPO_ROOT / "data" / "vocab.txt"


@pytest.fixture(scope="module")
def tokenizer():
    return squad.SquadTokenizer.from_vocab(VOCAB, do_lower_case=True)


@pytest.fixture(scope="module")
def long_paragraph():
    """About 300 words of real text: several 64-token windows."""
    text = " ".join(sample_sentences()[:40])
    return text[:text.index(" ", 1600)]


def wordpiece_text(tokenizer, ids):
    """The WordPiece tokens of ids joined back into words (an independent path from the char offsets)."""
    return " ".join(tokenizer.tokenizer.id_to_token(i) for i in ids).replace(" ##", "")


def example_for(context, answer, question="Where is it?", occurrence=0):
    start = -1
    for _ in range(occurrence + 1):
        start = context.index(answer, start + 1)
    return squad.SquadExample("id", question, context, [answer], start, answer)


# ----------------------------------------------------------------------------------------------------------
# Reading


def test_read_v1_and_v2(tmp_path):
    paragraphs = word_questions(sample_sentences()[:5], 2, seed=0)
    examples = squad.read_squad(write_squad(tmp_path / "v1.json", paragraphs), is_training=True,
                                version_2_with_negative=False)
    assert len(examples) == sum(len(p["qas"]) for p in paragraphs)
    first = paragraphs[0]["qas"][0]
    assert examples[0].qas_id == first["id"] and examples[0].answer_text == first["answers"][0]["text"]
    assert examples[0].context[examples[0].answer_start:].startswith(examples[0].answer_text)

    paragraphs[0]["qas"][0].update(answers=[], is_impossible=True)
    v2 = write_squad(tmp_path / "v2.json", paragraphs, version="v2.0")
    examples = squad.read_squad(v2, is_training=True, version_2_with_negative=True)
    assert examples[0].is_impossible and examples[0].answer_start == -1 and examples[0].gold_answers == []
    with pytest.raises(InputError, match=r"qas\[0\] .* is unanswerable .* needs --version_2_with_negative"):
        squad.read_squad(v2, is_training=True, version_2_with_negative=False)


def test_the_offline_sample_is_official_squad_with_true_spans(tmp_path):
    """data/squad_sample.py as docs/fine-tuning.md runs it: both versions in the official layout, every
    answer_start points at its answer text in the context, v2.0 adds questions about words their context
    does not hold, and the dev sets share no context with train."""
    done = subprocess.run([sys.executable, "data/squad_sample.py", "--output_dir", str(tmp_path), "--train", "60",
                           "--dev", "30"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env=helpers.checkout_env())
    assert done.returncode == 0, done.stderr
    contexts = {}
    for version, version_field in (("v1.1", "1.1"), ("v2.0", "v2.0")):
        for split in ("train", "dev"):
            path = tmp_path / version / f"{split}-{version}.json"
            document = json.loads(path.read_text())
            assert document["version"] == version_field and set(document) == {"version", "data"}
            paragraphs = [p for article in document["data"] for p in article["paragraphs"]]
            contexts[version, split] = {p["context"] for p in paragraphs}
            qas = [(p["context"], qa) for p in paragraphs for qa in p["qas"]]
            assert len({qa["id"] for _, qa in qas}) == len(qas)
            impossible = 0
            for context, qa in qas:
                named = re.fullmatch(r"Where is the word (\w+)\?", qa["question"]).group(1)
                occurrences = len(re.findall(rf"\b{named}\b", context, re.IGNORECASE))
                if qa.get("is_impossible"):
                    impossible += 1
                    assert qa["answers"] == [] and occurrences == 0, (context, qa)
                else:
                    (answer,) = qa["answers"]
                    start = answer["answer_start"]
                    assert context[start:start + len(answer["text"])] == answer["text"] == named, (context, qa)
                    assert occurrences == 1
            assert (impossible > 0) == (version == "v2.0"), (path, impossible)
            examples = squad.read_squad(path, is_training=True, version_2_with_negative=version == "v2.0")
            assert len(examples) == len(qas)  # none skipped for an answer not at its offset
        assert not contexts[version, "train"] & contexts[version, "dev"]


def test_the_offline_sample_refuses_more_sentences_than_the_books_hold(tmp_path):
    done = subprocess.run([sys.executable, "data/squad_sample.py", "--output_dir", str(tmp_path),
                           "--train", "10000000"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env=helpers.checkout_env())
    assert done.returncode == 1 and done.stderr.startswith("error: the sample books have "), done.stderr
    assert len(done.stderr.splitlines()) == 1 and not any(tmp_path.iterdir())


def test_prediction_file_needs_no_answers(tmp_path):
    path = write_squad(tmp_path / "test.json", [{"context": "Emma smiled.", "qas": [{"id": "1", "question": "Who?"}]}])
    (example,) = squad.read_squad(path, is_training=False, version_2_with_negative=False)
    assert example.gold_answers == [] and example.answer_start == -1
    with pytest.raises(InputError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[0\] has no 'answers' field"):
        squad.read_squad(path, is_training=True, version_2_with_negative=False)


@pytest.mark.parametrize("content, message", [
    ('{"data": [\n {"paragraphs": [}\n]}', r"malformed JSON at line 2 column 18"),
    ('{"version": "1.1"}', r"the top level has no 'data' field"),
    ('{"data": [{"paragraphs": [{"qas": []}]}]}', r"data\[0\]\.paragraphs\[0\] has no 'context' field"),
    ('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": "a"}]}]}]}',
     r"data\[0\]\.paragraphs\[0\]\.qas\[0\] has no 'question' field"),
    ('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": "a", "question": "q", "answers": '
     '[{"text": "x", "answer_start": "0"}]}]}]}]}', r"qas\[0\]\.answers\[0\]\.answer_start is a str, not int"),
    ('{"data": []}', r"holds no questions"),
    ('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": 1.5, "question": "q", "answers": []}]}]}]}',
     r"data\[0\]\.paragraphs\[0\]\.qas\[0\]\.id is a float, not str or int$"),
    ('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": true, "question": "q", "answers": []}]}]}]}',
     r"qas\[0\]\.id is a bool, not str or int$"),
])
def test_bad_files_name_the_place(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message) as error:
        squad.read_squad(path, is_training=True, version_2_with_negative=False)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)


def test_answer_not_at_its_offset_is_skipped_with_a_warning(tmp_path, capsys):
    path = write_squad(tmp_path / "t.json", [{"context": "Anne walked to Kellynch.", "qas": [
        {"id": "1", "question": "Who?", "answers": [{"text": "Anne", "answer_start": 0}]},
        {"id": "2", "question": "Where?", "answers": [{"text": "Kellynch", "answer_start": 3}]}]}])
    examples = squad.read_squad(path, is_training=True, version_2_with_negative=False)
    assert [e.qas_id for e in examples] == ["1"]
    assert "1 training question(s) skipped" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# Features


def test_window_starts_and_max_context_match_bert_rule():
    assert squad.window_starts(10, 4, 2) == [0, 2, 4, 6]
    assert squad.window_starts(4, 4, 2) == [0]
    assert squad.window_starts(11, 4, 3) == [0, 3, 6, 9]
    starts, window, n = [0, 3, 6, 9], 4, 11
    mask = squad.max_context_mask(n, starts, window)
    for token in range(n):  # BERT's rule, written out token by token
        best, best_score = None, None
        for w, start in enumerate(starts):
            length = min(window, n - start)
            if start <= token < start + length:
                score = min(token - start, start + length - 1 - token) + 0.01 * length
                if best_score is None or score > best_score:
                    best, best_score = w, score
        assert mask[:, token].tolist() == [w == best for w in range(len(starts))], token


def test_features_layout(tokenizer):
    context = "Elizabeth Bennet walked to Netherfield, three miles through the mud."
    example = example_for(context, "Netherfield")
    features = squad.convert_examples_to_features([example], tokenizer, max_seq_length=40, doc_stride=16,
                                                  max_query_length=8, is_training=True)
    question_ids = tokenizer.encode([example.question])[0][0]
    context_ids = tokenizer.encode([context])[0][0]
    row = features.input_ids[0]
    n = 1 + len(question_ids) + 1 + len(context_ids) + 1
    assert row[:n].tolist() == [tokenizer.cls_id, *question_ids, tokenizer.sep_id, *context_ids, tokenizer.sep_id]
    assert (row[n:] == tokenizer.pad_id).all() and features.attention_mask[0].tolist() == [1] * n + [0] * (40 - n)
    assert features.token_type_ids[0].tolist() == [0] * (len(question_ids) + 2) + [1] * (len(context_ids) + 1) + \
        [0] * (40 - n)
    start, end = features.start_positions[0], features.end_positions[0]
    assert wordpiece_text(tokenizer, row[start:end + 1].tolist()) == "netherfield"


def test_question_is_cut_to_max_query_length(tokenizer):
    example = example_for("Anne read the letter twice.", "letter", question=" ".join(["why"] * 30) + "?")
    features = squad.convert_examples_to_features([example], tokenizer, max_seq_length=32, max_query_length=5,
                                                  is_training=True)
    assert features.input_ids[0, 6] == tokenizer.sep_id and (features.token_type_ids[0, :7] == 0).all()


@pytest.mark.parametrize("context, answer, expected", [
    ("Mr. Darcy, who stood near them, smiled.", "Darcy", "darcy"),         # comma right after
    ("It was written (1813) by Austen.", "1813", "1813"),                  # inside parentheses
    ("She said: \"Kellynch!\" and left.", "Kellynch", "kellynch"),        # quotes and exclamation
    ("The Musgroves' house was full.", "Musgroves", "musgroves"),          # possessive apostrophe
    ("They met at Uppercross.", "Uppercross.", "uppercross ."),           # the answer ends with punctuation
    ("Anne  Elliot   sat down.", "Anne  Elliot", "anne elliot"),          # several spaces inside
    ("She was twenty-seven.", "twenty", "twenty"),                          # part of a hyphenated word
    ("Élise was in Bath.", "Élise", "elise"),                               # accents stripped by the tokenizer
])
def test_answer_spans_survive_punctuation_and_spacing(tokenizer, context, answer, expected):
    features = squad.convert_examples_to_features([example_for(context, answer)], tokenizer, max_seq_length=48,
                                                  max_query_length=16, is_training=True)
    start, end = features.start_positions[0], features.end_positions[0]
    assert start > 0
    assert wordpiece_text(tokenizer, features.input_ids[0, start:end + 1].tolist()) == expected
    first, last = features.context_offsets[0, start, 0], features.context_offsets[0, end, 1]
    assert context[first:last] == answer.strip()


def test_answer_with_leading_space_maps_to_the_word(tokenizer):
    context = "Then Wentworth came in."
    example = squad.SquadExample("id", "Who?", context, [" Wentworth"], context.index(" Wentworth"), " Wentworth")
    features = squad.convert_examples_to_features([example], tokenizer, max_seq_length=32, max_query_length=8,
                                                  is_training=True)
    start, end = features.start_positions[0], features.end_positions[0]
    assert context[features.context_offsets[0, start, 0]:features.context_offsets[0, end, 1]] == "Wentworth"


def test_doc_stride_windows_and_answer_positions(tokenizer, long_paragraph):
    """Every window that holds the whole answer points at it; the others point at [CLS]; windows start
    doc_stride tokens apart and together cover the context."""
    answer = long_paragraph.split()[150].strip(".,;:!?\"'")
    example = example_for(long_paragraph, answer, occurrence=long_paragraph[:long_paragraph.index(
        " ".join(long_paragraph.split()[150:152]))].count(answer))
    max_seq, stride, query = 64, 16, 8
    features = squad.convert_examples_to_features([example], tokenizer, max_seq, stride, query, is_training=True)
    context_ids, offsets = tokenizer.encode([long_paragraph])[0]
    question_len = len(tokenizer.encode([example.question])[0][0])
    window = max_seq - question_len - 3
    expected_windows = 1 + -(-max(0, len(context_ids) - window) // stride)
    assert len(features) == expected_windows > 3
    answer_first, answer_last = squad.answer_token_span(offsets, example.answer_start,
                                                        example.answer_start + len(answer))
    pointing = 0
    for f in range(len(features)):
        start_token = f * stride
        in_window = features.context_offsets[f, :, 0] >= 0
        assert in_window.sum() == min(window, len(context_ids) - start_token)
        assert (features.context_offsets[f][in_window] == offsets[start_token:start_token + in_window.sum()]).all()
        holds = start_token <= answer_first and answer_last < start_token + in_window.sum()
        s, e = features.start_positions[f], features.end_positions[f]
        if holds:
            pointing += 1
            assert long_paragraph[features.context_offsets[f, s, 0]:features.context_offsets[f, e, 1]] == answer
        else:
            assert s == e == 0
    assert pointing >= 1
    # each context token is the max-context token of exactly one window
    counts = np.zeros(len(context_ids), dtype=int)
    for f in range(len(features)):
        counts[np.flatnonzero(features.max_context[f]) - (question_len + 2) + f * stride] += 1
    assert (counts == 1).all()


def test_v2_unanswerable_points_at_cls_in_every_window(tokenizer, long_paragraph):
    example = squad.SquadExample("id", "Who is absent?", long_paragraph, [], is_impossible=True)
    features = squad.convert_examples_to_features([example], tokenizer, 64, 16, 8, is_training=True)
    assert len(features) > 3 and (features.start_positions == 0).all() and (features.end_positions == 0).all()


def test_too_short_max_seq_length_is_an_error(tokenizer):
    with pytest.raises(InputError, match=r"--max_seq_length \(11\) must be greater than --max_query_length \(8\) \+ 3"):
        squad.convert_examples_to_features([example_for("Anne.", "Anne")], tokenizer, max_seq_length=11,
                                           max_query_length=8)


# ----------------------------------------------------------------------------------------------------------
# Decoding


def peaked_logits(features, spans, seq_len, noise_seed=0):
    """Small random logits with +10 at the chosen (feature, start, end) positions."""
    rng = np.random.default_rng(noise_seed)
    start, end = rng.normal(0, 0.1, (len(features), seq_len)), rng.normal(0, 0.1, (len(features), seq_len))
    for f, s, e in spans:
        start[f, s] += 10
        end[f, e] += 10
    return start, end


def position_of(features, f, context, text):
    """(start, end) positions in feature f of the context characters of `text` (first occurrence)."""
    char = context.index(text)
    starts = features.context_offsets[f, :, 0]
    ends = features.context_offsets[f, :, 1]
    return int(np.flatnonzero(starts == char)[0]), int(np.flatnonzero(ends == char + len(text))[0])


def one_answer_case(tokenizer, context, answer, seq_len=64):
    """An example whose logits peak (+10) on `answer`: (example, features, start logits, end logits, s, e)."""
    example = squad.SquadExample("q", "Which?", context, [answer])
    features = squad.convert_examples_to_features([example], tokenizer, seq_len, max_query_length=16)
    s, e = position_of(features, 0, context, answer)
    start, end = peaked_logits(features, [(0, s, e)], seq_len)
    return example, features, start, end, s, e


def test_decoding_writes_the_original_text(tokenizer):
    context = "Sir Walter Elliot, of Kellynch-hall, in Somersetshire, was a man who never took up any book."
    example, features, start, end, _, _ = one_answer_case(tokenizer, context, "Kellynch-hall")
    result = squad.decode_predictions([example], features, start, end, n_best_size=5)
    assert result.answers == {"q": "Kellynch-hall"} and result.null_odds == {}
    nbest = result.nbest["q"]
    # at most n_best_size distinct texts, from the 5 best starts x 5 best ends that form valid spans
    assert 1 < len(nbest) <= 5 and nbest[0]["text"] == "Kellynch-hall"
    assert len({entry["text"] for entry in nbest}) == len(nbest)
    assert sum(entry["probability"] for entry in nbest) == pytest.approx(1.0)
    scores = [entry["start_logit"] + entry["end_logit"] for entry in nbest]
    assert scores == sorted(scores, reverse=True)
    assert set(nbest[0]) == {"text", "probability", "start_logit", "end_logit"}
    json.dumps(result.nbest)  # plain floats: the official nbest format serialises


def test_decoding_rejects_invalid_spans(tokenizer):
    """The best-scoring start and end form only invalid spans; the valid second best wins."""
    context = "Anne Elliot had been forced into prudence in her youth, she learned romance as she grew older."
    example = squad.SquadExample("q", "What did she learn?", context, ["romance"])
    features = squad.convert_examples_to_features([example], tokenizer, 64, max_query_length=16)
    s, e = position_of(features, 0, context, "romance")
    word = {w: position_of(features, 0, context, w)[0] for w in ("Anne", "she", "grew", "older")}
    cases = {"question tokens are not answers": (2, 2),
             "end before start": (word["grew"], word["she"]),
             "longer than max_answer_length": (word["Anne"], word["older"])}
    for why, (bad_start, bad_end) in cases.items():
        start, end = peaked_logits(features, [(0, bad_start, bad_end)], 64)
        start[0, s] += 7  # 14 in all: beats a bad start (10) with any other end, loses to the bad pair (20)
        end[0, e] += 7
        result = squad.decode_predictions([example], features, start, end, max_answer_length=3)
        assert result.answers["q"] == "romance", why


def test_decoding_uses_the_max_context_window(tokenizer, long_paragraph):
    example = squad.SquadExample("q", "Where?", long_paragraph, [])
    features = squad.convert_examples_to_features([example], tokenizer, 64, 16, 8)
    # the first token that window 1 gives the most context is also in window 0, at p0, without max context
    p1 = int(np.flatnonzero(features.max_context[1])[0])
    p0 = int(np.flatnonzero(features.context_offsets[0, :, 0] == features.context_offsets[1, p1, 0])[0])
    assert not features.max_context[0, p0]
    start, end = peaked_logits(features, [(0, p0, p0)], 64)
    start[0, p0] += 5
    end[0, p0] += 5  # window 0's span scores higher, but window 0 is not the token's max-context window
    start[1, p1] += 10
    end[1, p1] += 10
    result = squad.decode_predictions([example], features, start, end)
    assert result.nbest["q"][0]["start_logit"] == pytest.approx(start[1, p1])


def test_v2_null_score_rule(tokenizer):
    context = "Captain Wentworth wrote the letter at the White Hart."
    example, features, start, end, s, e = one_answer_case(tokenizer, context, "Captain Wentworth", seq_len=48)
    best = start[0, s] + end[0, e]
    for null, threshold, expected in [(best - 1, 0.0, "Captain Wentworth"), (best + 1, 0.0, ""),
                                      (best + 1, 2.0, "Captain Wentworth")]:
        start[0, 0], end[0, 0] = null / 2, null / 2
        result = squad.decode_predictions([example], features, start, end, version_2_with_negative=True,
                                          null_score_diff_threshold=threshold)
        assert result.answers["q"] == expected
        assert result.null_odds["q"] == pytest.approx(null - best)
        texts = [entry["text"] for entry in result.nbest["q"]]
        assert "" in texts and "Captain Wentworth" in texts


def test_v2_null_score_is_the_minimum_over_windows(tokenizer, long_paragraph):
    example = squad.SquadExample("q", "Where?", long_paragraph, [])
    features = squad.convert_examples_to_features([example], tokenizer, 64, 16, 8)
    start, end = peaked_logits(features, [], 64)
    start[:, 0], end[:, 0] = 3.0, 3.0
    start[2, 0], end[2, 0] = 1.0, 0.5
    result = squad.decode_predictions([example], features, start, end, version_2_with_negative=True)
    best = max(entry["start_logit"] + entry["end_logit"] for entry in result.nbest["q"] if entry["text"])
    assert result.null_odds["q"] == pytest.approx(1.5 - best)


# ----------------------------------------------------------------------------------------------------------
# Download (from a local file:// mirror: the real site is not reachable from the tests)


def test_download_verifies_and_skips(tmp_path):
    from data import squad_download
    from data.bert_prep import fetch_verified, file_digest
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    checksums = {}
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        write_squad(mirror / name, word_questions(sample_sentences()[:3], 1, seed=0))
        checksums[name] = file_digest(mirror / name, "sha256")
    out = tmp_path / "squad"
    paths = squad_download.download(out, ["v1.1"], mirror.as_uri(), checksums)
    assert paths == [out / "v1.1" / "train-v1.1.json", out / "v1.1" / "dev-v1.1.json"]
    assert all(path.read_bytes() == (mirror / path.name).read_bytes() for path in paths)
    assert not fetch_verified("file:///nonexistent", paths[0], "sha256", checksums["train-v1.1.json"])

    paths[1].write_text("{}")  # a damaged local copy is detected and set aside
    with pytest.raises(InputError, match=r"dev-v1\.1\.json: SHA-256 .* moved to .*\.bad"):
        squad_download.download(out, ["v1.1"], mirror.as_uri(), checksums)
    assert (out / "v1.1" / "dev-v1.1.json.bad").exists() and not paths[1].exists()
    squad_download.download(out, ["v1.1"], mirror.as_uri(), checksums)  # the rerun downloads it again
    assert paths[1].read_bytes() == (mirror / "dev-v1.1.json").read_bytes()


def test_download_cli_rejects_wrong_content(tmp_path):
    import subprocess
    import sys
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("train-v2.0.json", "dev-v2.0.json"):
        (mirror / name).write_text('{"data": []}')
    result = subprocess.run([sys.executable, str(REPO_ROOT / "data" / "squad_download.py"), "--output_dir",
                             str(tmp_path / "squad"), "--versions", "v2.0"], capture_output=True, text=True,
                            env={"SQUAD_BASE_URL": mirror.as_uri(), "PATH": "", "PYTHONPATH": str(REPO_ROOT)},
                            timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith("squad_download.py: error: ")
    assert "train-v2.0.json: SHA-256" in result.stderr and "68dcfbb971bd" in result.stderr
