package docscheck_test

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

var (
	mdLink   = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)\)`)
	codeSpan = regexp.MustCompile("`[^`]*`")
	heading  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*$`)
	fence    = regexp.MustCompile("^\\s*```")
)

// Every relative link of README.md and docs/*.md reaches a file or folder of the repository,
// and every #anchor into a Markdown file a heading of it (GitHub's anchor rules).
func TestLinks(t *testing.T) {
	root := moduleRoot(t)
	anchors := map[string]map[string]bool{}
	anchorsOf := func(file string) (map[string]bool, error) {
		if a, ok := anchors[file]; ok {
			return a, nil
		}
		md, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(file)))
		if err != nil {
			return nil, err
		}
		a, seen := map[string]bool{}, map[string]int{}
		for _, line := range proseLines(string(md)) {
			if m := heading.FindStringSubmatch(line.text); m != nil {
				slug := githubSlug(m[1])
				if n := seen[slug]; n > 0 {
					a[fmt.Sprintf("%s-%d", slug, n)] = true
				} else {
					a[slug] = true
				}
				seen[slug]++
			}
		}
		anchors[file] = a
		return a, nil
	}
	checked := 0
	for _, file := range markdownFiles(t, root) {
		md, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range proseLines(string(md)) {
			for _, m := range mdLink.FindAllStringSubmatch(codeSpan.ReplaceAllString(line.text, ""), -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				checked++
				rel, frag, _ := strings.Cut(target, "#")
				dest := file
				if rel != "" {
					dest = path.Clean(path.Join(path.Dir(file), rel))
				}
				if _, err := os.Stat(filepath.Join(root, filepath.FromSlash(dest))); err != nil {
					t.Errorf("%s:%d: link %q: %s does not exist", file, line.n, target, dest)
					continue
				}
				if frag == "" || !strings.HasSuffix(dest, ".md") {
					continue
				}
				a, err := anchorsOf(dest)
				if err != nil {
					t.Errorf("%s:%d: link %q: %v", file, line.n, target, err)
				} else if !a[frag] {
					t.Errorf("%s:%d: link %q: %s has no heading with anchor #%s", file, line.n, target, dest, frag)
				}
			}
		}
	}
	t.Logf("%d relative links checked", checked)
}

type numbered struct {
	n    int
	text string
}

// proseLines returns the lines of a Markdown text outside fenced code blocks.
func proseLines(md string) []numbered {
	var out []numbered
	inFence := false
	for i, l := range strings.Split(md, "\n") {
		if fence.MatchString(l) {
			inFence = !inFence
			continue
		}
		if !inFence {
			out = append(out, numbered{i + 1, l})
		}
	}
	return out
}

// githubSlug is the anchor GitHub gives a heading: lower case, punctuation dropped (hyphens
// and underscores kept), spaces turned into hyphens.
func githubSlug(h string) string {
	h = strings.ReplaceAll(h, "`", "")
	h = mdLink.ReplaceAllStringFunc(h, func(s string) string { return s[1:strings.Index(s, "]")] })
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

func TestGithubSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Per-key order: the precondition, and what consumers see": "per-key-order-the-precondition-and-what-consumers-see",
		"Effects outside PostgreSQL: the Redis store (weaker)":    "effects-outside-postgresql-the-redis-store-weaker",
		"The transaction-first core: `ClaimTx` and `SeenTx`":      "the-transaction-first-core-claimtx-and-seentx",
		"Why `balance = balance - 50` needs a dedup row":          "why-balance--balance---50-needs-a-dedup-row",
	} {
		if got := githubSlug(in); got != want {
			t.Errorf("githubSlug(%q) = %q, want %q", in, got, want)
		}
	}
}
