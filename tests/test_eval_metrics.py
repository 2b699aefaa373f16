"""Hand-computed checks of the metric functions in benchmarks/eval_beir.py (no engine needed)."""
import importlib.util
import math
import tempfile
import unittest
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "eval_beir.py"
_spec = importlib.util.spec_from_file_location("eval_beir", _PATH)
ev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ev)


class TestNdcg(unittest.TestCase):
    def test_binary_gains(self):
        # relevant a at rank 1, c at rank 3: DCG = 1/log2(2) + 1/log2(4) = 1.5
        # ideal: two relevant at ranks 1, 2: IDCG = 1 + 1/log2(3) = 1.630930
        got = ev.ndcg_at_k(["a", "b", "c"], {"a": 1, "c": 1}, 10)
        self.assertAlmostEqual(got, 1.5 / (1 + 1 / math.log2(3)), places=9)
        self.assertAlmostEqual(got, 0.919721, places=6)

    def test_graded_gains(self):
        # a (grade 2) at rank 2, b (grade 1) at rank 3: DCG = 2/log2(3) + 1/2 = 1.761860
        # ideal a, b at ranks 1, 2: IDCG = 2 + 1/log2(3) = 2.630930
        got = ev.ndcg_at_k(["x", "a", "b"], {"a": 2, "b": 1}, 10)
        self.assertAlmostEqual(got, 0.669672, places=6)

    def test_perfect_and_empty(self):
        self.assertAlmostEqual(ev.ndcg_at_k(["a", "b"], {"a": 1, "b": 1}, 10), 1.0)
        self.assertEqual(ev.ndcg_at_k([], {"a": 1}, 10), 0.0)
        self.assertEqual(ev.ndcg_at_k(["a"], {}, 10), 0.0)

    def test_cutoff_and_ideal_capped_at_k(self):
        ranked = [f"n{i}" for i in range(10)] + ["a"]          # relevant only at rank 11
        self.assertEqual(ev.ndcg_at_k(ranked, {"a": 1}, 10), 0.0)
        # 3 relevant documents but k = 2: ideal uses only 2 of them, so two hits at ranks 1-2 score 1.0
        self.assertAlmostEqual(ev.ndcg_at_k(["a", "b"], {"a": 1, "b": 1, "c": 1}, 2), 1.0)

    def test_zero_grade_not_relevant(self):
        self.assertEqual(ev.ndcg_at_k(["a"], {"a": 0, "b": 1}, 10), 0.0)


class TestRecall(unittest.TestCase):
    def test_recall_at_k(self):
        ranked = ["a"] + [f"n{i}" for i in range(48)] + ["b"]  # a at rank 1, b at rank 50
        judged = {"a": 1, "b": 1}
        self.assertEqual(ev.recall_at_k(ranked, judged, 10), 0.5)
        self.assertEqual(ev.recall_at_k(ranked, judged, 100), 1.0)
        self.assertEqual(ev.recall_at_k(ranked, {"a": 1, "b": 1, "c": 1, "d": 1}, 100), 0.5)

    def test_recall_edge_cases(self):
        self.assertEqual(ev.recall_at_k([], {"a": 1}, 10), 0.0)
        self.assertEqual(ev.recall_at_k(["a"], {}, 10), 0.0)
        self.assertEqual(ev.recall_at_k(["a"], {"a": 0}, 10), 0.0)


class TestMrr(unittest.TestCase):
    def test_first_relevant_rank(self):
        self.assertEqual(ev.mrr_at_k(["a", "b", "c"], {"c": 1, "b": 1}, 10), 0.5)
        self.assertAlmostEqual(ev.mrr_at_k(["x", "y", "c"], {"c": 1}, 10), 1 / 3)
        self.assertEqual(ev.mrr_at_k(["c"], {"c": 2}, 10), 1.0)

    def test_outside_cutoff(self):
        ranked = [f"n{i}" for i in range(10)] + ["c"]
        self.assertEqual(ev.mrr_at_k(ranked, {"c": 1}, 10), 0.0)
        self.assertAlmostEqual(ev.mrr_at_k(ranked, {"c": 1}, 11), 1 / 11)


class TestHelpers(unittest.TestCase):
    def test_first_hit_per_doc(self):
        self.assertEqual(ev.first_hit_per_doc(["a", "a", None, "b", "a", "c"], 10), ["a", "b", "c"])
        self.assertEqual(ev.first_hit_per_doc(["a", "b", "c"], 2), ["a", "b"])

    def test_percentile_and_mean(self):
        self.assertEqual(ev.percentile([1, 2, 3, 4, 5], 50), 3.0)
        self.assertAlmostEqual(ev.percentile([0, 10], 95), 9.5)
        self.assertEqual(ev.percentile([], 50), 0.0)
        self.assertEqual(ev.mean([1, 2]), 1.5)

    def test_read_qrels_skips_header(self):
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "q.tsv"
            p.write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n1\td2\t2\n2\td3\t0\n", encoding="utf-8")
            self.assertEqual(ev.read_qrels(p), {"1": {"d1": 1, "d2": 2}, "2": {"d3": 0}})

    def test_markdown_and_stems(self):
        self.assertEqual(ev.document_markdown("T", "body"), "# T\n\n## Abstract\n\nbody\n")
        self.assertEqual(ev.document_markdown("", "body"), "## Abstract\n\nbody\n")
        self.assertEqual(ev.stem_for("csl-dev-0001"), "csl-dev-0001")
        self.assertNotIn("/", ev.stem_for("a/b"))


if __name__ == "__main__":
    unittest.main()
