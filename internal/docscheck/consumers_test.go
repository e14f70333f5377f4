package docscheck_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"testing"

	"github.com/onceflow/onceflow/internal/docscheck"
)

// Every Go block of README.md and docs/*.md gives each router handler a subscriber, and so a
// consumer group, of its own: one subscriber passed to AddConsumerHandler twice, or in a loop
// over topics, puts the handlers into one group, where each one's rebalances stall the
// others (docs/sagas.md, "One consumer group per handler"). Readers copy these blocks.
func TestOneConsumerGroupPerHandler(t *testing.T) {
	root := moduleRoot(t)
	checked := 0
	for _, file := range markdownFiles(t, root) {
		md, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		bs, err := docscheck.Blocks(file, string(md))
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range bs {
			b.Skip, b.QuoteFile = "", "" // quoted and skipped blocks are read too
			files, err := docscheck.Package("doc_x", []docscheck.Block{b})
			if err != nil || len(files) == 0 {
				continue // not Go this test can read; TestGoBlocksCompile reports it
			}
			fset := token.NewFileSet()
			f, err := parser.ParseFile(fset, "", files[0].Source, 0)
			if err != nil {
				continue
			}
			checked++
			for _, v := range sharedSubscribers(f) {
				t.Errorf("%s: subscriber %q is given to AddConsumerHandler %s: give each handler a subscriber (consumer group) of its own",
					fset.Position(v.pos), v.name, v.why)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no Go block read")
	}
}

type sharedSub struct {
	name, why string
	pos       token.Pos
}

// sharedSubscribers finds, in each function of f, a subscriber variable passed to
// AddConsumerHandler more than once, or inside a loop that does not create it.
func sharedSubscribers(f *ast.File) []sharedSub {
	var out []sharedSub
	var inspectBody func(body *ast.BlockStmt)
	inspectBody = func(body *ast.BlockStmt) {
		uses := map[string]int{}
		var walk func(n ast.Node, loops []ast.Node)
		walk = func(n ast.Node, loops []ast.Node) {
			ast.Inspect(n, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.FuncLit:
					inspectBody(n.Body)
					return false
				case *ast.ForStmt:
					walk(n.Body, append(loops, n.Body))
					return false
				case *ast.RangeStmt:
					walk(n.Body, append(loops, n.Body))
					return false
				case *ast.CallExpr:
					sel, ok := n.Fun.(*ast.SelectorExpr)
					if !ok || sel.Sel.Name != "AddConsumerHandler" || len(n.Args) != 4 {
						return true
					}
					id, ok := n.Args[2].(*ast.Ident)
					if !ok {
						return true
					}
					uses[id.Name]++
					if uses[id.Name] == 2 {
						out = append(out, sharedSub{id.Name, "twice", n.Pos()})
					}
					if len(loops) > 0 && !assigns(loops[len(loops)-1], id.Name) {
						out = append(out, sharedSub{id.Name, "in a loop that does not create it", n.Pos()})
					}
				}
				return true
			})
		}
		walk(body, nil)
	}
	for _, d := range f.Decls {
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
			inspectBody(fd.Body)
		}
	}
	return out
}

// assigns reports whether n assigns (or declares) the variable name.
func assigns(n ast.Node, name string) bool {
	found := false
	ast.Inspect(n, func(n ast.Node) bool {
		if as, ok := n.(*ast.AssignStmt); ok {
			for _, l := range as.Lhs {
				if id, ok := l.(*ast.Ident); ok && id.Name == name {
					found = true
				}
			}
		}
		return !found
	})
	return found
}
