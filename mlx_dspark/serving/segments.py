"""Where a chat prompt's segments end: the token counts at which the server
keeps a snapshot of the request's target cache.

A later request shares a conversation's prompt up to the end of its system
prompt (another conversation with the same instructions and tools), or up to
the end of a user turn (the same conversation's next turn, whatever the
template does with the answer in between). A target whose caches cannot be
cut back (sliding-window and recurrent layers) reuses only a snapshot taken
exactly there. The ends are found by rendering the conversation's leading
messages with the same template and taking how many tokens they share with
the whole prompt, as ``mlx_lm.server`` finds the end of the system prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .prompt_cache import common_prefix

# Rendering costs a tokenization per turn: only the last few user turns.
MAX_USER_TURNS = 4


def segment_ends(
    render: Callable[[list[dict]], Sequence[int]],
    messages: list[dict],
    prompt: Sequence[int],
) -> tuple[int, ...]:
    """The ends (token counts, ascending, each shorter than ``prompt``) of
    the system prompt and of the last :data:`MAX_USER_TURNS` user turns.

    ``render(messages)`` tokenizes a conversation without the generation
    prompt; a rendering that fails or shares nothing with ``prompt`` adds no
    end.
    """
    system = 0
    while system < len(messages) and messages[system].get("role") == "system":
        system += 1
    heads = []
    if system:
        # An empty user turn after it, as templates that want one expect.
        heads.append([*messages[:system], {"role": "user", "content": ""}])
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    heads += [messages[: i + 1] for i in users[-MAX_USER_TURNS:]]
    ends = set()
    for head in heads:
        try:
            ids = list(render(head))
        except Exception:  # a template that refuses this conversation's head
            continue
        n = common_prefix(ids, prompt)
        if 0 < n < len(prompt):
            ends.add(n)
    return tuple(sorted(ends))
