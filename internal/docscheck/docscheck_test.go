package docscheck_test

import (
	"go/parser"
	"go/token"
	"strings"
	"testing"

	"github.com/onceflow/onceflow/internal/docscheck"
)

func TestBlocks(t *testing.T) {
	md := "# t\n\n```go\nx := 1\n```\n\n<!-- docscheck:skip needs kadm -->\n```go\nkadm.X()\n```\n\n" +
		"* item\n\n  ```go\n  y := 2\n  ```\n\n```sh\nmake test\n```\n\n" +
		"<!-- docscheck:quote a/b_test.go quickstart -->\n```go\nz := 3\n```\n"
	bs, err := docscheck.Blocks("doc.md", md)
	if err != nil {
		t.Fatal(err)
	}
	want := []docscheck.Block{
		{File: "doc.md", Line: 4, Code: "x := 1\n"},
		{File: "doc.md", Line: 9, Code: "kadm.X()\n", Skip: "needs kadm"},
		{File: "doc.md", Line: 15, Code: "y := 2\n"},
		{File: "doc.md", Line: 24, Code: "z := 3\n", QuoteFile: "a/b_test.go", QuoteRegion: "quickstart"},
	}
	if len(bs) != len(want) {
		t.Fatalf("got %d blocks %+v, want %d", len(bs), bs, len(want))
	}
	for i := range want {
		if bs[i] != want[i] {
			t.Errorf("block %d = %+v, want %+v", i, bs[i], want[i])
		}
	}
	if _, err := docscheck.Blocks("doc.md", "```go\nx := 1\n"); err == nil {
		t.Error("an unclosed block was accepted")
	}
}

func TestPackage(t *testing.T) {
	for _, tc := range []struct {
		name    string
		code    string
		want    []string // substrings of the generated source
		wantErr string
	}{
		{
			name: "statements use ambient names; declared variables need not be used",
			code: "ib, err := inbox.New(inbox.Config{Pool: pool, Consumer: \"billing\"})\n",
			want: []string{
				`inbox "github.com/onceflow/onceflow/inbox"`,
				`pgxpool "github.com/jackc/pgx/v5/pgxpool"`,
				"func _(pool *pgxpool.Pool) error {",
				"//line doc.md:3\n",
				"_ = ib\n", "_ = err\n", "return nil",
			},
		},
		{
			name: "declarations stay at the top level",
			code: "func reserve(ctx context.Context, tx pgx.Tx) error { return nil }\n",
			want: []string{`context "context"`, `pgx "github.com/jackc/pgx/v5"`, "//line doc.md:3\nfunc reserve("},
		},
		{
			name: "a leading import declaration is kept and its lines counted",
			code: "import (\n\t\"github.com/onceflow/onceflow/relay\"\n\trk \"github.com/onceflow/onceflow/relay/relaykafka\"\n)\n\nsink, err := rk.NewSink(rk.Config{Brokers: brokers})\n_, _ = relay.New(relay.Config{Sink: sink})\n",
			want: []string{`rk "github.com/onceflow/onceflow/relay/relaykafka"`, `relay "github.com/onceflow/onceflow/relay"`, "func _(brokers []string) error", "//line doc.md:7\n"},
		},
		{
			name:    "neither declarations nor statements",
			code:    "id := ... // elided\n",
			wantErr: "doc.md:3",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			files, err := docscheck.Package("doc_x", []docscheck.Block{{File: "doc.md", Line: 3, Code: tc.code}})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			src := files[0].Source
			for _, w := range tc.want {
				if !strings.Contains(src, w) {
					t.Errorf("generated source lacks %q:\n%s", w, src)
				}
			}
			if _, err := parser.ParseFile(token.NewFileSet(), "", src, 0); err != nil {
				t.Errorf("generated source does not parse: %v\n%s", err, src)
			}
		})
	}
}

// A declaration of one block is visible to the others: it is neither an import nor ambient.
func TestPackageSharesDeclarations(t *testing.T) {
	files, err := docscheck.Package("doc_x", []docscheck.Block{
		{File: "doc.md", Line: 1, Code: "var checkout = 1\n"},
		{File: "doc.md", Line: 5, Code: "x := checkout + 1\n_ = ctx\n"},
		{File: "doc.md", Line: 9, Code: "ignored()\n", Skip: "a sketch"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 {
		t.Fatalf("got %d files, want 2 (the skipped block is left out)", len(files))
	}
	if src := files[1].Source; !strings.Contains(src, "func _(ctx context.Context) error") {
		t.Errorf("second block:\n%s", src)
	}
}

func TestRegion(t *testing.T) {
	src := "package p\n\n// a:begin\n\nfunc A() {}\n\n// a:end\n"
	got, err := docscheck.Region(src, "a")
	if err != nil || got != "func A() {}\n" {
		t.Fatalf("Region = %q, %v", got, err)
	}
	if _, err := docscheck.Region(src, "b"); err == nil {
		t.Fatal("a missing region was found")
	}
}

func TestPackageName(t *testing.T) {
	for in, want := range map[string]string{"README.md": "doc_readme", "docs/http-idempotency.md": "doc_http_idempotency", "docs/PERFORMANCE.md": "doc_performance"} {
		if got := docscheck.PackageName(in); got != want {
			t.Errorf("PackageName(%q) = %q, want %q", in, got, want)
		}
	}
}
