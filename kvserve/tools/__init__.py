"""Tools between prompts and outputs: definitions rendered into the prompt (rendering), the grammar a call
must follow (grammar), calls parsed back out of the output (parsing), all in one call layout (calls)."""
