"""The documents tell the truth: CI runs README's test command; the layout table is real;
every page README links to exists."""

import re
from pathlib import Path

import fmoe
from fmoe.params import flat_shapes

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text):
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    install_and_train, install_and_test = bash_blocks(readme)[:2]
    assert "fmoe.train" in install_and_train and "pytest" in install_and_test
    assert install_and_test.strip() in (ROOT / ".ci" / "run").read_text()


def layout_table_paths(readme):
    """Expand the table's first column: "`a.b.c`, `.d`" names a.b.c and a.b.d."""
    section = readme.split("## Parameter layout")[1].split("\n## ")[0]
    paths = set()
    for row in re.findall(r"^\| (`.*?) \|", section, flags=re.M):
        names = [n for n in re.findall(r"`([^`]+)`", row) if re.fullmatch(r"[\w.\[\]]+", n)]
        prefix = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        paths.add(names[0])
        paths.update(prefix + n for n in names[1:])
    return paths


def test_readme_layout_table_names_every_leaf():
    every_leaf = fmoe.ModelConfig(expert_biases=True, shared_ffn=8, shared_gate=True, qk_norm="head", qkv_bias=True,
                                  out_bias=True, dense_layers=(0,), dense_ffn=8, router_bias=True, attn_sinks=True)
    latent = every_leaf.replace(qk_norm="none", qkv_bias=False, head_size=12, kv_lora_rank=8, rope_head_dim=4)
    layout = {re.sub(r"^layers\.\d+", "layers[i]", p) for cfg in (every_leaf, latent, latent.replace(q_lora_rank=8))
              for p in flat_shapes(cfg)}
    assert layout_table_paths((ROOT / "docs" / "semantics.md").read_text()) == layout


def test_every_link_between_the_documents_leads_to_a_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 5
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to {target}, which is not there"
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in pages[1:]}, "README links to every page of docs/"
