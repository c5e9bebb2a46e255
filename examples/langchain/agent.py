"""A LangGraph calculator agent, written as the LangGraph quickstart writes one.

The graph, the model and the tools are plain LangChain/LangGraph; the only areal-sdk line is
``@areal.trace`` on the entry function. Run it with ``areal-sdk rollout
examples/langchain/config.yaml``: inside a rollout the ``ChatOpenAI`` below (left at its
defaults) talks to the policy behind the gateway; outside one it talks to OpenAI as usual.
"""

from __future__ import annotations

from typing import Literal

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

import areal_sdk as areal

model = ChatOpenAI(model="gpt-4o-mini", temperature=0)


@tool
def add(a: int, b: int) -> int:
    """Add a and b."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply a and b."""
    return a * b


tools = [add, multiply]
tools_by_name = {t.name: t for t in tools}
model_with_tools = model.bind_tools(tools)


def llm_call(state: MessagesState) -> dict:
    """The model decides whether to call a tool or answer."""
    system = SystemMessage(
        content="You are a careful calculator. Use the tools, then give the final number."
    )
    return {"messages": [model_with_tools.invoke([system, *state["messages"]])]}


def tool_node(state: MessagesState) -> dict:
    """Run the tool calls of the last message."""
    result = []
    for tool_call in state["messages"][-1].tool_calls:
        observation = tools_by_name[tool_call["name"]].invoke(tool_call["args"])
        result.append(ToolMessage(content=str(observation), tool_call_id=tool_call["id"]))
    return {"messages": result}


def should_continue(state: MessagesState) -> Literal["tool_node", "__end__"]:
    return "tool_node" if state["messages"][-1].tool_calls else END


builder = StateGraph(MessagesState)
builder.add_node("llm_call", llm_call)
builder.add_node("tool_node", tool_node)
builder.add_edge(START, "llm_call")
builder.add_conditional_edges("llm_call", should_continue, ["tool_node", END])
builder.add_edge("tool_node", "llm_call")
graph = builder.compile()


@areal.trace
def solve(task: dict) -> str:
    """Answer one task; the config's ``agent.reward`` scores the returned text."""
    state = graph.invoke(
        {"messages": [HumanMessage(content=task["question"])]}, {"recursion_limit": 8}
    )
    return state["messages"][-1].content
