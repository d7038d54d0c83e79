"""SQuAD-format files that the tests write from real sentences of data/sample/ (no download).

The learning task: the context is a real sentence, the question names one of its words, and the answer is
that word. A tiny BERT can learn to point at the named word; the shuffled variant (the answer is another
word of the sentence, at random) cannot be learned and is the negative control.
"""
import json
import random
import re
from pathlib import Path

from finetune_helpers import REPO_ROOT, book_sentences  # noqa: F401  (REPO_ROOT is re-exported)

TEMPLATE_WORDS = {"where", "the", "word"}  # never asked for (and "the" normalises away)


def sample_sentences():
    """Sentences of 8 to 30 words of the sample novels, in book order."""
    return book_sentences(min_words=8, max_words=30)


def candidate_words(sentence):
    """Words of 3+ letters that occur once in the sentence (case-insensitive), except 'the' and the
    question template's words, with their character offsets."""
    words = {}
    for match in re.finditer(r"[A-Za-z]{3,}", sentence):
        word = match.group()
        if (word.lower() not in TEMPLATE_WORDS and word not in words
                and len(re.findall(rf"\b{word}\b", sentence, re.IGNORECASE)) == 1):
            words[word] = match.start()
    return words


def word_questions(sentences, per_sentence, seed, id_prefix="q", shuffled=False):
    """SQuAD paragraphs: per sentence, up to per_sentence questions 'Where is the word W?' about candidate
    words W; the answer is W. shuffled=True (the negative control): the answer is another candidate word
    of the sentence, drawn at random, so the question does not determine it."""
    rng = random.Random(seed)
    paragraphs = []
    for s, sentence in enumerate(sentences):
        words = candidate_words(sentence)
        if len(words) < 2:
            continue
        qas = []
        for word in rng.sample(sorted(words), min(per_sentence, len(words))):
            answer = rng.choice([w for w in sorted(words) if w != word]) if shuffled else word
            qas.append({"id": f"{id_prefix}{s}-{word}", "question": f"Where is the word {word}?",
                        "answers": [{"text": answer, "answer_start": words[answer]}]})
        paragraphs.append({"context": sentence, "qas": qas})
    return paragraphs


def write_squad(path, paragraphs, version="1.1", title="sample"):
    """A SQuAD JSON file with one article holding `paragraphs`; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": version, "data": [{"title": title, "paragraphs": paragraphs}]}))
    return path
