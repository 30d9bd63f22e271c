"""The one way from a task's prompt to token ids.

Every prompt the job sends to a model is encoded here: a task's own prompt
(`dlbatch.prompts.stage.PromptStage`), the map and reduce prompts of a chunked task
(`dlbatch.prompts.longdoc.ChunkPlan`, in the prompt stage and again in the driver's
`dlbatch.prompts.map_reduce.MapReduce`), and an OpenAI batch line's chat. So a prompt of a
task is built the same way whichever of them builds it:

- through the chat template (``model.chat_template``'s text, else the tokenizer's own),
  unless the model has none, ``model.chat`` is false or the task is ``raw``;
- with the system prompt first: the task's ``system``, else ``model.system``; a chat that
  brings its own system (or developer) message keeps it;
- with the template kwargs ``model.chat_template_kwargs`` and the task's over them (e.g.
  Qwen3's ``enable_thinking: false``).

A prompt is a string (one user message) or a chat, a list of ``{"role", "content"}``
messages (a ``messages`` task, an OpenAI batch line), which needs a chat template. A raw
prompt is encoded with the tokenizer's special tokens (BOS); a templated one without them,
since the template writes its own.

Plain object: the tokenizer, the job's ``model`` section and ``tasks`` (anything with
their attributes) and the template's text, nothing read later, so the prompt stage in Ray
Data's actors and the driver build equal encoders from the same job (`for_job`).
"""
from __future__ import annotations

from typing import Sequence, Union


class PromptEncoder:
    def __init__(self, tokenizer, model, tasks: Sequence, template: str | None = None):
        """``model``: the job's model section (``chat``, ``system``, ``chat_template_kwargs``);
        ``tasks``: the job's tasks (``name``, ``system``, ``chat_template_kwargs``, ``raw``);
        ``template``: the text of ``model.chat_template``'s file (None: the tokenizer's own)."""
        self.tok = tokenizer
        self.template = template
        has_template = template is not None or tokenizer.chat_template is not None
        self.chat = has_template if model.chat is None else bool(model.chat)
        self.system = model.system
        self.kwargs = dict(model.chat_template_kwargs)
        self.tasks = list(tasks)
        self.index = {t.name: k for k, t in enumerate(self.tasks)}

    @classmethod
    def for_job(cls, spec, tokenizer) -> "PromptEncoder":
        """The encoder of a validated job (`dlbatch.jobspec.JobSpec`): its model section, its
        tasks and its chat template file's text."""
        template = None
        if spec.model.chat_template is not None:
            with open(spec.model.chat_template, encoding="utf-8") as f:
                template = f.read()
        return cls(tokenizer, spec.model, spec.tasks, template)

    def task(self, task: Union[int, str]):
        """A task by its index in the job or its name."""
        if isinstance(task, str):
            if task not in self.index:
                raise KeyError(f"task {task!r} is not a task of this job (tasks: {', '.join(self.index)})")
            return self.tasks[self.index[task]]
        return self.tasks[task]

    def encode(self, task: Union[int, str], prompt: Union[str, list]) -> list[int]:
        """Task ``task``'s prompt (a string, or a chat: a list of messages) -> token ids."""
        t = self.task(task)
        if isinstance(prompt, list):
            if not self.chat:
                raise ValueError(f"task {t.name!r} gives messages, but the model has no chat template "
                                 "(set model.chat_template)")
            return self._templated(t, prompt)
        if t.raw or not self.chat:
            return self.tok.encode(prompt)
        return self._templated(t, [{"role": "user", "content": prompt}])

    def _templated(self, t, messages: list) -> list[int]:
        """``messages`` through the chat template, after the task's system prompt unless they
        have their own. The system message comes before the document, so the tasks share it
        as prefix only when every task has the same one."""
        system = t.system if t.system is not None else self.system
        if system and not any(m["role"] in ("system", "developer") for m in messages):
            messages = [{"role": "system", "content": system}] + messages
        text = self.tok.apply_chat_template(messages, template=self.template,
                                            **{**self.kwargs, **t.chat_template_kwargs})
        return self.tok.encode(text, add_special_tokens=False)
