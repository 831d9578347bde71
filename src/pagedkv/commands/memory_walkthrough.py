"""`pagedkv demo --memory`: paged KV memory step by step on a pool small enough to read.

Each stage performs real KVCacheManager operations and prints the block tables, the plans
the runner would execute (copy-on-write, swap) and a map of the pool: which sequence holds
each block, which blocks are shared, which are free but still hold cached KV.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedkv.memory import KVCacheManager

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 10
NUM_CPU_BLOCKS = 6
OWNER_STYLES = [
    "bold white on blue",
    "bold white on magenta",
    "bold black on yellow",
    "bold white on dark_green",
    "bold black on cyan",
    "bold white on red",
]


def run_walkthrough() -> int:
    """Walk through growth, reuse, prefix sharing, copy-on-write and swap."""
    demo = MemoryDemo(Console())
    demo.run()
    return 0


class MemoryDemo:
    """Drives one KVCacheManager through the stages and renders its state after each."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.manager = KVCacheManager(NUM_GPU_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
        self.styles: dict[str, str] = {}

    def run(self) -> None:
        """All stages in order; ends with every block free and the invariants checked."""
        m = self.manager
        self.console.rule("[bold]pagedkv: paged KV memory, one operation at a time")
        self.console.print(
            f"{NUM_GPU_BLOCKS} GPU blocks and {NUM_CPU_BLOCKS} CPU blocks of {BLOCK_SIZE} "
            "token slots each. Tokens are plain ids; the runner would move the KV bytes. In the "
            "pool map, 'cache' marks a free block still holding prefix-cache KV."
        )

        self.stage("1. Two prompts arrive: blocks only for the tokens they have")
        for seq_id, prompt in (("A", [11, 12, 13, 14, 15, 16]), ("B", [21, 22, 23])):
            m.allocate(seq_id, prompt)
            m.mark_computed(seq_id, len(prompt))
        self.show()

        self.stage("2. Decoding, token by token: a new block only at a block boundary")
        for step in range(6):
            for seq_id in ("A", "B"):
                before = len(m.block_table(seq_id))
                m.append(seq_id, [100 + step])
                m.mark_computed(seq_id, m.num_tokens(seq_id))
                if len(m.block_table(seq_id)) > before:
                    self.note(
                        f"{seq_id} reached {m.num_tokens(seq_id)} tokens: took block "
                        f"{m.block_table(seq_id)[-1]}"
                    )
        self.show()

        self.stage("3. A finishes: its blocks return to the pool; full ones keep cached KV")
        finished_tokens = [11, 12, 13, 14, 15, 16, 100, 101]  # A's prompt and first 2 outputs
        m.free("A")
        self.show()

        self.stage("4. C shares A's first 8 prompt tokens: served from the prefix cache")
        cached = m.allocate("C", finished_tokens + [31, 32])
        self.note(f"C's prompt has 10 tokens; {cached} were already computed, 10 - {cached} to go")
        m.mark_computed("C", m.num_tokens("C"))
        self.show()

        self.stage("5. Parallel sampling: fork C into C and D, then they diverge")
        m.fork("C", "D")
        self.note("D shares every block of C (ref count 2), no copy made")
        self.show()
        for seq_id, token in (("D", 41), ("C", 51)):
            plan = m.append(seq_id, [token])
            m.mark_computed(seq_id, m.num_tokens(seq_id))
            if plan:
                self.note(f"{seq_id} writes into the shared last block: copy-on-write {plan}")
            else:
                self.note(f"{seq_id} is now the only holder of its last block: writes in place")
        self.show()

        self.stage("6. Preemption by swapping: B goes to CPU memory and comes back")
        plan = m.swap_out("B")
        self.note(f"swap_out plan (gpu_block, cpu_block): {plan}")
        self.show()
        plan = m.swap_in("B")
        self.note(f"swap_in plan (cpu_block, gpu_block): {plan}")
        self.note(
            f"{len(m.block_table('B')) - len(plan)} full blocks were still cached on the GPU: "
            "reused, not copied"
        )
        self.show()

        self.stage("7. Everyone finishes")
        for seq_id in m.seq_ids:
            m.free(seq_id)
        m.check_invariants()
        self.show()
        stats = m.stats
        leaked = (m.num_gpu_blocks - m.num_free_blocks) + (m.num_cpu_blocks - m.num_free_cpu_blocks)
        self.console.print(
            f"prefix cache: {stats.prefix_hit_tokens} of {stats.prefix_queried_tokens} prompt "
            f"tokens hit · copy-on-write copies: {stats.cow_copies} · blocks swapped out/in: "
            f"{stats.blocks_swapped_out}/{stats.blocks_swapped_in} · invariants hold, "
            + ("no block leaked." if leaked == 0 else f"{leaked} blocks leaked.")
        )

    def stage(self, title: str) -> None:
        """Print a stage heading."""
        self.console.print()
        self.console.rule(f"[bold cyan]{title}", align="left")

    def note(self, text: str) -> None:
        """Print one event of the current stage."""
        self.console.print(f"  [dim]•[/dim] {text}")

    def show(self) -> None:
        """Block tables of every sequence, then the GPU pool map."""
        m = self.manager
        if m.seq_ids:
            table = Table(box=None, padding=(0, 2), show_edge=False)
            for column in ("seq", "tokens", "block table", "where"):
                table.add_column(column)
            for seq_id in m.seq_ids:
                where = "CPU" if m.is_swapped_out(seq_id) else "GPU"
                table.add_row(
                    Text(seq_id, style=self.style(seq_id)),
                    str(m.num_tokens(seq_id)),
                    str(m.block_table(seq_id)),
                    where,
                )
            self.console.print(table)
        self.console.print(self.pool_map())

    def pool_map(self) -> Text:
        """One cell per GPU block: owner (shared blocks list all), or free / cached-free."""
        m = self.manager
        owners: dict[int, list[str]] = {}
        for seq_id in m.seq_ids:
            if not m.is_swapped_out(seq_id):
                for block in m.block_table(seq_id):
                    owners.setdefault(block, []).append(seq_id)
        line = Text("  block " + "".join(f"{block:^6} " for block in range(NUM_GPU_BLOCKS)))
        line.append("\n  held  ")
        for block in range(NUM_GPU_BLOCKS):
            holders = owners.get(block)
            if holders:
                label, style = "+".join(holders), self.style(holders[0])
            elif m.is_cached(block):
                label, style = "cache", "italic green"
            else:
                label, style = "free", "dim"
            line.append(f"{label:^6}", style=style)
            line.append(" ")
        line.append(
            f"\n  {NUM_GPU_BLOCKS - m.num_free_blocks} used, {m.num_free_blocks} free "
            f"(usage {m.usage:.0%}); CPU {NUM_CPU_BLOCKS - m.num_free_cpu_blocks} used, "
            f"{m.num_free_cpu_blocks} free",
            style="dim",
        )
        return line

    def style(self, seq_id: str) -> str:
        """A stable colour per sequence."""
        return self.styles.setdefault(seq_id, OWNER_STYLES[len(self.styles) % len(OWNER_STYLES)])
