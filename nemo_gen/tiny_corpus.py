"""The text the tiny model's tokenizer is trained on (``nemo_gen.tiny_model``): plain English,
numbers and symbols, so its byte-level BPE vocabulary covers what prompts in tests contain.
Changing it changes the tokenizer, and with it every token id a tiny-model test sees."""

CORPUS = """\
The engine wakes before the city does. It loads its weights, warms its caches, and waits for
the first request of the day. A prompt arrives: a question about the weather, a line of code,
a story that needs an ending. The engine reads every token, one after another, and answers
with tokens of its own until it reaches the end of the sequence or runs out of room.

Nobody in the control room watches a single engine. They watch the fleet. When one machine
stops answering, the others take its work, and a spare steps in while the lost one is brought
back. The rule is simple and strict: a shard that comes back must first learn the newest
weights, and only then may it serve again. Old answers from old weights are worse than none.

In the morning the trainer sends new weights. They travel in buckets, each one named, shaped
and checked before anything is written. If a bucket is wrong, the whole update is refused and
the shard keeps what it had. If the update is right, every shard moves to the new version
together, and every sample it returns carries the version that produced it.

Outside, the river runs past the old mill and under the stone bridge. Children throw bread to
the ducks, and a man with a grey dog reads the paper on a bench. The baker opens at seven, the
library at nine, and the market fills with apples, pears, onions, bread, cheese and flowers.
People talk about the rain that is coming, the train that was late, and the game on Sunday.

Learning is mostly patience. You try something small, measure what happened, and write down
the numbers. Then you change one thing and measure again. Good tools make the loop short; good
notes make it honest. A result you cannot repeat is a rumour, and a test that never fails
tells you nothing at all about the code it claims to guard.

Language models learn which words tend to follow which. Given enough text they pick up
spelling, grammar, facts and style; given random weights they produce fluent nonsense, which
is exactly what a test needs: the same prompt, the same seed, the same tokens, every time.
Small models start in seconds, fit in a few megabytes, and exercise the same code paths as
large ones, from the tokenizer to the sampler to the scheduler that batches requests together.

Numbers and symbols matter too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 128, 2048, 3.14, 1e-5, 50%,
(a + b) * c = d; x[i] -> y[j]; "quoted", 'single', {key: value}, <tag/>, #hash, @name, $cost,
path/to/file.txt, user@example.com, https://example.org/index.html ? yes ! no ... maybe.
"""
