package api

import (
	"strings"
	"testing"
)

func TestParseShareConfig(t *testing.T) {
	ok := `{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig"`
	for in, want := range map[string]int64{
		ok + `}`:                            0,
		ok + `,"memoryLimit":"30Gi"}`:       30720,
		ok + `,"memoryLimit":"1536Mi"}`:     1536,
		ok + `,"memoryLimit":"2147483648"}`: 2048,
	} {
		got, err := ParseShareConfig([]byte(in))
		if err != nil || got != want {
			t.Errorf("%s: %d, %v; want %d", in, got, err, want)
		}
	}
	for in, want := range map[string]string{
		ok + `,"memoryLimit":"lots"}`:              `memoryLimit "lots"`,
		ok + `,"memoryLimit":"-1Gi"}`:              `memoryLimit "-1Gi"`,
		ok + `,"memoryLimit":"100Ki"}`:             "at least 1Mi",
		ok + `,"memorylimit":"1Gi"}`:               `unknown field "memorylimit"`,
		`{"apiVersion":"v1","kind":"ShareConfig"}`: `apiVersion "v1"`,
		`{"apiVersion":"gpu.gpufrac.io/v1alpha1"}`: `kind ""`,
		`[1]`:                         "cannot unmarshal",
		ok + `} {}`:                   "after top-level value",
		ok + `,"kind":"ShareConfig"}`: "duplicate field",
		``:                            "unexpected end",
	} {
		if _, err := ParseShareConfig([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one saying %q", in, err, want)
		}
	}
}

func FuzzParseShareConfig(f *testing.F) {
	f.Add([]byte(`{"apiVersion":"gpu.gpufrac.io/v1alpha1","kind":"ShareConfig","memoryLimit":"30Gi"}`))
	f.Add([]byte(`{"memoryLimit":"1e3"}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		limit, err := ParseShareConfig(raw)
		if err == nil && limit < 0 {
			t.Fatalf("%q: negative limit %d", raw, limit)
		}
		if err != nil && (strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), "opaque parameters")) {
			t.Fatalf("%q: error %q is not one line naming the parameters", raw, err)
		}
	})
}
