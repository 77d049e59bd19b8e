"""The prompt-ordering lab's pure views: lab results in, figures and Markdown out."""
