"""The one prompt builder: every API's conversation becomes token ids here, and only here.

Chat completions, completions, Messages, Responses, /tokenize, count_tokens and the replicas' ingress all
call it, so a prompt is the same ids whichever way it came in, and the ingress's routing hashes are the
replica's block hashes by construction.

- builder.py    `Conversation` (turns, tools, marks, generation prompt) -> `Prompt` (ids, marks in tokens):
                tool rendering, the model's chat template and its errors, answers spliced back as the ids
                the model generated, breakpoints placed in tokens.
- answers.py    `GeneratedAnswers`: the ids each answer that made tool calls was generated as, per tenant
                and bounded, so the next turn's prompt holds them exactly (token-exact tool loops).
- segments.py   `TurnSegments`: a stored conversation continued turn by turn (Responses'
                previous_response_id), never re-rendering the history.
"""
