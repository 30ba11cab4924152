"""Agents for the subprocess-mode tests (importable by the child process by module path)."""

import os
import subprocess

import openai


class EnvAgent:
    """Finds the endpoint in OPENAI_BASE_URL / OPENAI_API_KEY, as any OpenAI program does."""

    async def run(self, data):
        client = openai.AsyncOpenAI(max_retries=0)
        reply = await client.chat.completions.create(model="any", messages=data["messages"])
        await client.close()
        return 0.5 + len(reply.choices[0].message.content)


class FailingAgent:
    async def run(self, data):
        raise LookupError(f"no answer for {data['messages'][0]['content']}")


class HangingAgent:
    """Writes its pid, then waits on a completion the engine never finishes."""

    async def run(self, data):
        with open(data["pid_file"], "w") as f:
            f.write(str(os.getpid()))
        client = openai.AsyncOpenAI(max_retries=0, timeout=600)
        await client.chat.completions.create(model="any", messages=data["messages"])
        return 1.0


class ExitingAgent:
    async def run(self, data):
        os._exit(3)


class SpawningAgent:
    """Starts a ``sleep 1000`` child (its pid goes to ``pid_file``), then waits on a completion
    the engine never finishes."""

    async def run(self, data):
        child = subprocess.Popen(["sleep", "1000"])
        with open(data["pid_file"], "w") as f:
            f.write(str(child.pid))
        client = openai.AsyncOpenAI(max_retries=0, timeout=600)
        await client.chat.completions.create(model="any", messages=data["messages"])
        return 1.0


class SetsidSpawningAgent:
    """Starts a ``sleep 1000`` child in its own session (its pid goes to ``pid_file``) and returns."""

    async def run(self, data):
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        with open(data["pid_file"], "w") as f:
            f.write(str(child.pid))
        return 1.0


class ClaudeEnvAgent:
    """Finds the endpoint in ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, as any Anthropic program does."""

    async def run(self, data):
        import anthropic

        client = anthropic.AsyncAnthropic(max_retries=0)
        reply = await client.messages.create(model="any", max_tokens=16, messages=data["messages"])
        await client.close()
        return 0.5 + len(reply.content[0].text)
